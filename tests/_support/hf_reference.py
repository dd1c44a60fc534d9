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


#: Greedy comparisons on random tiny models may diverge only right after a near-tie:
#: a step whose top-2 logit gap in the reference is below this.
NEAR_TIE = 1e-4


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ``generate`` without its cache: ``(tokens, logits [steps, V])``.

    Without the cache on purpose: transformers 5.23's cached NemotronH decode skips the
    ``time_step_min`` clamp of dt that its chunked (prefill) path applies, so its cached
    ``generate`` disagrees with its own forward (|Δlogit| ~1e-2 after ~50 tokens).
    jaxmamba applies the clamp on both paths, as the model defines it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        # eos_token_id=None, not min_new_tokens: min_new_tokens bans EOS from being chosen, while
        # vLLM's ignore_eos (what the engine tests use) lets EOS be generated and just does not stop.
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, eos_token_id=None,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             use_cache=False)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, f"transformers stopped after {len(tokens)} of {max_new_tokens} tokens"
    return tokens, torch.stack(out.logits, 1)[0].float().numpy()


def assert_greedy_match(ours: list[int], ref_tokens: list[int], ref_logits: np.ndarray, what: str = "") -> None:
    """Token-identical, except that after a near-tie (top-2 gap < NEAR_TIE) the rest may differ."""
    assert len(ours) == len(ref_tokens), f"{what}: {len(ours)} tokens vs {len(ref_tokens)}"
    for step, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a == b:
            continue
        top2 = np.sort(ref_logits[step])[-2:]
        gap = float(top2[1] - top2[0])
        assert gap < NEAR_TIE, f"{what}: token {step} differs ({a} vs {b}) with top-2 gap {gap:.2e} (not a near-tie)"
        return
