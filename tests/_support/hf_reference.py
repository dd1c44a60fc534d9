"""The transformers (torch, CPU) reference: build HF checkpoints and run them.

Checkpoints are written by transformers' own ``save_pretrained`` from a model
whose weights are jaxmamba's deterministic random init, read by transformers' own loader (transformers' default
init gives near-zero logits, which would make every comparison vacuous).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmamba.random_checkpoint import random_model


def hf_checkpoint(tmp: Path, family: str, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """Save a transformers model of ``family`` (tiny, random weights) under ``tmp``; return its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    staged = random_model(family, seed=seed, path=tmp / f"staged-{family}-{seed}", **overrides)
    # transformers reads our tensors through its own name conversions, then writes the checkpoint itself.
    model, info = AutoModelForCausalLM.from_pretrained(staged, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert all(k.endswith(("mup_vector", "inv_freq")) for k in info["missing_keys"]), info
    model = model.eval().to(getattr(torch, dtype))
    out = tmp / f"{family}-{seed}-{dtype}"
    model.save_pretrained(out)
    return out


def hf_logits(path: Path, input_ids: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(input_ids)).logits.float().numpy()


def hf_hidden_states(path: Path, input_ids: np.ndarray) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.as_tensor(input_ids), output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states]
