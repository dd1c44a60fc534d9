"""``VllmPrefill``: vLLM as the prefill (P) tier of jaxmamba's P/D contract (docs/architecture.md, "P/D across
frameworks"): ``directories()`` and ``prefill(prompts) -> list[Handoff]`` as jaxmamba's ``PrefillEngine``, so
an unchanged ``DecodeEngine.connect(...)`` / ``generate(handoffs, params)`` continues vLLM's requests."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from jaxmamba.errors import ConfigError, SlotError
from transfer.nixl_agent import RequestPages
from transfer.staging import Handoff, StagingExporter, StagingPool
from transfer.vllm_pages.caches import VllmCaches, cdiv

#: What vLLM runs for a prompt: its first N-1 tokens; the one token it samples is dropped.
_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class VllmPrefill(StagingExporter):
    """The P side on a running ``vllm.LLM`` (in this process, DS conv layout, no prefix caching: ``VllmCaches``).

    vLLM computes each prompt's first ``N-1`` tokens; when its scheduler frees the finished request, the
    request's Mamba slot and KV blocks (from vLLM's block table) are copied into a host ``StagingPool``
    laid out as a TP=1 jaxmamba engine's caches with ``block_size`` tokens per KV block (the decode
    engine's; default vLLM's attention block size) and registered with one NIXL ``PageExporter``.
    ``staging_requests`` handoffs can wait to be read at once; ``poll`` frees what decode engines have
    read (``StagingExporter``). ``max_model_len`` bounds the KV blocks staged per request.
    """

    def __init__(self, vllm_llm, *, engine_id: str = "vllm", block_size: int | None = None,
                 staging_requests: int = 4, max_model_len: int | None = None, progress_thread: bool = True):
        if "|" in engine_id or "/" in engine_id:
            raise ConfigError(f"engine_id={engine_id!r} must not contain '|' or '/' (they delimit handoff ids)")
        self.llm, self.engine_id = vllm_llm, engine_id
        self.caches = VllmCaches(vllm_llm)
        self.mamba_layers, self.kv_layers = tuple(self.caches.mamba), tuple(self.caches.attention)
        self.block_size = int(block_size or self.caches.attention_block_size or 1)
        max_len = int(max_model_len or vllm_llm.llm_engine.model_config.max_model_len)
        blocks_per_request = cdiv(max_len, self.block_size) if self.kv_layers else 0
        n = staging_requests
        staging = StagingPool(self.caches.staging_shapes(self.block_size), 1, n + 1, n * blocks_per_request + 1)
        self._export(engine_id, staging, self.mamba_layers, self.kv_layers, progress_thread=progress_thread)
        self._ids = itertools.count()
        # Staged requests by prompt (vLLM's scheduler knows its requests by internal ids that LLM.generate
        # does not return; equal prompts have equal state, so any of them serves).
        self._captured: dict[tuple[int, ...], list[Handoff]] = {}
        self._watching = False
        self._install_free_hook()

    def _install_free_hook(self) -> None:
        """Stage a finished request's pages right before vLLM's scheduler frees its blocks (its forward is
        done and nothing has reused them yet): the only moment its block table and state both exist."""
        scheduler = self.caches.scheduler
        free_blocks = scheduler._free_blocks

        def stage_then_free(request):
            if self._watching:
                self._capture(request)
            return free_blocks(request)

        scheduler._free_blocks = stage_then_free

    def _capture(self, request) -> None:
        ids = tuple(int(t) for t in request.prompt_token_ids)
        n = len(ids)
        num_blocks = cdiv(n, self.block_size) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        if got is None:
            self._captured.setdefault(ids, []).append(Handoff(self.engine_id, ids, error=(
                f"prefill engine {self.engine_id!r}: staging pool full ({self.num_staged} handoffs not read yet)")))
            return
        s_slot, s_blocks = got
        slots, blocks = self.caches.request_state(request.request_id)
        for i, layer in enumerate(self.mamba_layers):
            self.staging.conv[0][i][s_slot], self.staging.ssm[0][i][s_slot] = self.caches.read_mamba(layer, slots[layer])
        for j, layer in enumerate(self.kv_layers):
            tokens = self.caches.read_kv_tokens(layer, blocks[layer], n)  # (2, n, K, head_dim)
            padded = np.zeros((2, num_blocks * self.block_size, *tokens.shape[2:]), tokens.dtype)
            padded[:, :n] = tokens
            self.staging.kv[0][j][:, s_blocks] = padded.reshape(2, num_blocks, self.block_size, *tokens.shape[2:])
        handoff_id = f"{self.engine_id}/{next(self._ids)}"
        self._track(handoff_id, s_slot, s_blocks)
        pages = RequestPages(handoff_id, mamba={layer: (s_slot,) for layer in self.mamba_layers},
                             kv={layer: tuple(s_blocks) for layer in self.kv_layers})
        # The prompt's last token is filled in by prefill(): vLLM only saw the first N-1.
        self._captured.setdefault(ids, []).append(Handoff(self.engine_id, ids, n, pages))

    def prefill(self, prompts: Sequence[Sequence[int]]) -> list[Handoff]:
        """vLLM computes every prompt's first ``N-1`` tokens; one ``Handoff`` per prompt (token ids), in order.

        A one-token prompt gets a handoff without pages (the decode engine computes it); a prompt that finds
        the staging pool full gets one with ``error`` set.
        """
        handoffs: list[Handoff | None] = [None] * len(prompts)
        todo = []
        for index, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if len(ids) < 2:
                handoffs[index] = Handoff(self.engine_id, tuple(ids))
            else:
                todo.append((index, ids))
        self.poll()
        self._captured.clear()
        self._watching = True
        try:
            self.llm.generate([TokensPrompt(prompt_token_ids=ids[:-1]) for _, ids in todo], _PREFILL_PARAMS,
                              use_tqdm=False)
        finally:
            self._watching = False
        for index, ids in todo:
            captured = self._captured[tuple(ids[:-1])].pop()
            handoffs[index] = Handoff(captured.engine_id, tuple(ids), captured.num_computed_tokens, captured.pages,
                                      captured.error)
        return handoffs  # type: ignore[return-value]

    def staged_pages(self, handoff: Handoff) -> dict[str, np.ndarray]:
        """Copies of a staged handoff's pages: ``{layer: conv (conv_dim, R)}`` under ``"<layer>.conv"``,
        ``ssm (H, P, N)`` under ``"<layer>.ssm"``, ``kv (2, num_blocks, block_size, K, head_dim)`` under
        ``"<layer>.kv"`` (for comparing the state at the handoff, layer by layer)."""
        if handoff.pages is None or handoff.handoff_id not in self._staged:
            raise SlotError(f"handoff {handoff.handoff_id!r} has no staged pages here")
        out = {}
        for i, layer in enumerate(self.mamba_layers):
            (slot,) = handoff.pages.mamba[layer]
            out[f"{layer}.conv"] = self.staging.conv[0][i][slot].copy()
            out[f"{layer}.ssm"] = self.staging.ssm[0][i][slot].copy()
        for j, layer in enumerate(self.kv_layers):
            out[f"{layer}.kv"] = self.staging.kv[0][j][:, list(handoff.pages.kv[layer])].copy()
        return out
