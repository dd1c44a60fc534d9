"""Cross-framework comparison: the same checkpoint through transformers (torch, CPU) and jaxmamba.

Reports, per residual-stream position (embedding, each layer's output, the
final norm), the max |Δ| between the two frameworks, then the logit |Δ| and the
greedy-token agreement. Needs the ``torch`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class CompareResult:
    checkpoint: str
    family: str
    dtype: str
    input_shape: tuple[int, int]
    rows: list[tuple[str, str, float]] = field(default_factory=list)  # (position, layer kind, max |Δ|)
    logits_max_abs: float = 0.0
    logits_scale: float = 0.0
    argmax_agreement: float = 0.0
    tolerance: float = 1e-4

    @property
    def logits_rel(self) -> float:
        return self.logits_max_abs / max(self.logits_scale, 1e-30)

    @property
    def ok(self) -> bool:
        return self.logits_rel <= self.tolerance


def _hf_positions(family: str, kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """Names of the entries of transformers' ``hidden_states`` tuple for this family.

    Mamba2 reports every block's output then the final norm; the other families
    report the embedding, every block's output but the last, then the final norm.
    """
    layers = [(f"layer {i}", k) for i, k in enumerate(kinds)]
    if family == "mamba2":
        return layers + [("final_norm", "norm")]
    return [("embed", "embedding")] + layers[:-1] + [("final_norm", "norm")]


def compare_with_transformers(
    path: str | Path, *, batch: int = 2, seq_len: int = 37, dtype: str = "float32", seed: int = 0,
    tolerance: float | None = None,
) -> CompareResult:
    # Here, not at the top: torch and transformers are the optional torch extra, and CompareResult (which
    # jaxmamba.report reads back from JSON) stays importable without JAX.
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from jaxmamba.weights import load_pretrained

    model = load_pretrained(path, dtype=dtype)
    cfg = model.cfg
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, seq_len)).astype(np.int32)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        hf_out = hf(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
    hf_hidden = [h.float().numpy() for h in hf_out.hidden_states]
    hf_logits = hf_out.logits.float().numpy()

    ours_stream = model.hidden_states(jnp.asarray(ids))
    ours = {"embed": ours_stream[0], "final_norm": model.final_norm(ours_stream[-1])}
    ours.update({f"layer {i}": h for i, h in enumerate(ours_stream[1:])})
    ours_logits = np.asarray(model.logits(ours_stream[-1]), np.float32)

    result = CompareResult(str(path), cfg.family, dtype, (batch, seq_len),
                           tolerance=tolerance if tolerance is not None else (1e-4 if dtype == "float32" else 5e-2))
    for (name, kind), theirs in zip(_hf_positions(cfg.family, cfg.layer_types), hf_hidden, strict=True):
        mine = np.asarray(ours[name], np.float32)
        result.rows.append((name, kind, float(np.abs(mine - theirs).max())))
    result.logits_max_abs = float(np.abs(ours_logits - hf_logits).max())
    result.logits_scale = float(np.abs(hf_logits).max())
    result.argmax_agreement = float((ours_logits.argmax(-1) == hf_logits.argmax(-1)).mean())
    return result


def format_report(r: CompareResult) -> str:
    lines = [
        f"checkpoint: {r.checkpoint}",
        f"family: {r.family}   dtype: {r.dtype}   input: batch {r.input_shape[0]} x {r.input_shape[1]} tokens",
        "",
        f"{'position':<14}{'kind':<12}{'max |Δ|':>12}",
    ]
    lines += [f"{name:<14}{kind:<12}{delta:>12.3e}" for name, kind, delta in r.rows]
    lines += [
        "",
        f"logits: max |Δ| = {r.logits_max_abs:.3e}   scale = {r.logits_scale:.3f}   "
        f"relative = {r.logits_rel:.3e}   (tolerance {r.tolerance:.0e})",
        f"greedy argmax agreement: {100 * r.argmax_agreement:.2f}%",
        "OK" if r.ok else "MISMATCH",
    ]
    return "\n".join(lines)
