"""The P side of P/D disaggregation: ``PrefillEngine`` computes a prompt's first ``N-1`` tokens, copies the
request's pages into host staging and hands a ``Handoff`` to the decode engine (see the package docstring)."""

from __future__ import annotations

import time
from typing import Any, Sequence

from jaxmamba.engine.disagg.handoff import (Handoff, StagingPool, agree, layer_names, local_ranks, side_gather,
                                            tp_size_of)
from jaxmamba.engine.llm import LLM
from jaxmamba.engine.request import Request, SamplingParams
from jaxmamba.engine.scheduler import cdiv
from jaxmamba.errors import ConfigError, RequestError
from jaxmamba.metadata import CacheMode
from jaxmamba.parallel import rank_pages
from transfer.nixl_bridge import RequestPages
from transfer.staging import StagingExporter

#: What the P engine runs for a prompt: its first N-1 tokens; the one token it samples is dropped.
_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class PrefillEngine(StagingExporter):
    """The P side: ``prefill(prompts)`` -> one ``Handoff`` per prompt; ``poll`` frees what D has read.

    ``llm`` may run at any TP size and must use ``mamba_cache_mode='none'`` (the state after the
    last computed token is then column 0 of the request's Mamba table). ``staging_requests``
    (default ``max_num_seqs``) handoffs can wait to be read at once. One ``PageExporter`` (NIXL
    agent) per TP rank registers that rank's staging pages; ``directories()`` is what decode
    engines ``connect`` to. ``progress_thread=False`` saves the core NIXL's progress thread spins;
    the owner then calls ``poll`` every millisecond or so while idle (it drives READs and
    notifications), and READs wait while the engine computes. A handoff stays staged until every
    reader has notified or ``release`` is called: there is no lease, so pages a dead decode engine
    never read stay staged until the caller releases them (freeing them on a timer instead could
    hand a slow reader another request's bytes; ``remote.PrefillServer`` frees a dropped decode
    engine's handoffs only once its lease says it can no longer read them). ``ucx_devices``: the
    network devices NIXL/UCX serves READs over (``PageExporter``).

    Over several processes (``llm``'s mesh spans them, jax.distributed): every process builds this engine
    and makes the same calls in the same order (``remote.PrefillServer`` has process 0 publish them to
    the others); each stages and registers only its own ranks (``local_ranks``) and frees them on its
    own ranks' READ notifications. The processes agree on every staging allocation (any process full:
    all wait) and on giving up on a full pool, so every process holds and releases the same requests
    at the same steps; ``directories()`` is every process's, gathered once here.
    """

    def __init__(self, llm: LLM, *, engine_id: str, staging_requests: int | None = None,
                 progress_thread: bool = True, ucx_devices: str | None = None):
        if llm.kv.cache_mode != CacheMode.NONE:
            raise ConfigError(f"a prefill engine exports the state after a request's last token, which needs "
                              f"mamba_cache_mode='none' (got {llm.kv.cache_mode!r})")
        if "|" in engine_id or "/" in engine_id:
            raise ConfigError(f"engine_id={engine_id!r} must not contain '|' or '/' (they delimit handoff ids)")
        self.llm, self.engine_id = llm, engine_id
        self.tp = tp_size_of(llm)
        self.mamba_layers, self.kv_layers = layer_names(llm.cfg)
        n = staging_requests or llm.scheduler.max_num_seqs
        blocks_per_request = cdiv(llm.max_model_len, llm.block_size) if self.kv_layers else 0
        self.local_ranks = local_ranks(llm)
        self._gather = side_gather(llm, "prefill", 60.0)
        self._export(engine_id, StagingPool(llm.runner.caches, self.tp, n + 1, n * blocks_per_request + 1),
                     self.mamba_layers, self.kv_layers, progress_thread=progress_thread, ucx_devices=ucx_devices,
                     ranks=self.local_ranks)
        self._directories = None
        if self._gather is not None:
            local = [d.decode() for d in super().directories()]
            self._directories = [d.encode() for v in self._agree("directories", local=local) for d in v["local"]]

    def directories(self) -> list[bytes]:
        """One ``PageDirectory`` per P rank, serialised (every process's ranks when the engine spans several)."""
        return super().directories() if self._directories is None else list(self._directories)

    def _agree(self, subject: str, **mine: Any) -> list[dict]:
        return agree(self._gather, f"prefill engine {self.engine_id!r}", subject, **mine)

    def prefill(self, prompts: Sequence[Any], *, staging_wait_s: float = 30.0) -> list[Handoff]:
        """Compute every prompt's first ``N-1`` tokens and stage their pages; one ``Handoff`` per prompt, in order.

        A prompt the engine refuses (``RequestError``), or one that finds the staging pool full for
        ``staging_wait_s`` (decode engines not reading), gets a handoff with ``error`` set and no
        pages: the decode engine computes it itself.
        """
        llm, sched = self.llm, self.llm.scheduler
        handoffs: list[Handoff | None] = []
        computing: dict[str, tuple[int, list[int]]] = {}  # engine request id -> (index, full prompt)
        for prompt in prompts:
            ids = llm.prompt_token_ids(prompt)
            if len(ids) < 2:  # nothing before the last token: the decode engine starts from scratch
                handoffs.append(Handoff(self.engine_id, tuple(ids)))
                continue
            try:
                req = llm.add_request(ids[:-1], _PREFILL_PARAMS)
            except RequestError as err:
                handoffs.append(Handoff(self.engine_id, tuple(ids), error=f"prefill engine {self.engine_id!r}: {err}"))
                continue
            sched.hold_on_finish.add(req.request_id)
            computing[req.request_id] = (len(handoffs), ids)
            handoffs.append(None)
        idle_since: float | None = None
        while computing:
            progressed = sched.has_work
            if progressed:
                llm.step()
            self.poll()
            for rid in [r for r in computing if r in sched.held]:
                index, ids = computing[rid]
                handoff = self._stage(sched.held[rid], ids)
                if handoff is None:  # staging full: stays held in the engine until D reads something
                    break
                handoffs[index] = handoff
                del computing[rid]
                progressed = True
            if progressed or not computing:
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            waited = time.monotonic() - idle_since > staging_wait_s
            if any(v["waited"] for v in self._agree("staging wait", waited=waited)):
                for rid, (index, ids) in computing.items():
                    sched.release_held(rid)
                    handoffs[index] = Handoff(self.engine_id, tuple(ids), error=(
                        f"prefill engine {self.engine_id!r}: staging pool full for {staging_wait_s:g} s "
                        f"({self.num_staged} handoffs not read yet)"))
                break
            time.sleep(0.001)
        return handoffs

    def _stage(self, req: Request, prompt_ids: list[int]) -> Handoff | None:
        """Stage a held request (its whole prompt, ``prompt_ids[:-1]``, computed) and release it; None if staging is full."""
        handoff = self.stage_request(req, prompt_ids, req.num_prompt_tokens)
        if handoff is not None:
            self.llm.scheduler.release_held(req.request_id)
        return handoff

    def stage_request(self, req: Request, prompt_ids: Sequence[int], num_computed_tokens: int) -> Handoff | None:
        """Copy the pages of ``req`` (a request of this engine's LLM whose state is the one after its first
        ``num_computed_tokens`` tokens: held after a prefill, or admitted by ``DecodeEngine.import_now``)
        from the caches into staging, every rank; the handoff to ``prompt_ids`` (the whole prompt). None
        if staging is full. The request itself is left as it is (the caller frees it).

        Staged per rank: conv ``(conv_dim_local, R)`` and SSM ``(H_local, P, N)`` of its state slot per
        Mamba layer, KV ``(2, cdiv(n, block_size), block_size, K_local, head_dim)`` of its first blocks
        per attention layer, in the caches' dtypes.
        """
        rid, n = req.request_id, num_computed_tokens
        if not 0 < n < len(prompt_ids):
            raise RequestError(f"num_computed_tokens={n} must be in [1, {len(prompt_ids)}) for request {rid!r}")
        num_blocks = cdiv(n, self.llm.block_size) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        if not all(v["got"] for v in self._agree(f"stage {rid!r}", got=got is not None)):
            if got is not None:  # another process's pool is full: all wait alike
                self.staging.free(*got)
            return None
        s_slot, s_blocks = got
        kv = self.llm.kv
        slot = kv.state_table(rid)[0] if self.mamba_layers else 0  # mode none: the state after token n
        blocks = kv.kv_block_ids(rid)[:num_blocks]
        for rank in self.local_ranks:
            # Zero-copy views of the device buffers on CPU; dropped before the engine steps again.
            pages = rank_pages(self.llm.runner.caches, rank)
            for i in range(len(self.mamba_layers)):
                self.staging.conv[rank][i][s_slot] = pages.conv[i][slot]
                self.staging.ssm[rank][i][s_slot] = pages.ssm[i][slot]
            for j in range(len(self.kv_layers)):
                self.staging.kv[rank][j][:, s_blocks] = pages.kv[j][:, blocks]
            del pages
        handoff_id = f"{self.engine_id}/{rid}"
        self._track(handoff_id, s_slot, s_blocks)
        request_pages = RequestPages(handoff_id, mamba={layer: (s_slot,) for layer in self.mamba_layers},
                                     kv={layer: tuple(s_blocks) for layer in self.kv_layers})
        return Handoff(self.engine_id, tuple(prompt_ids), n, request_pages)
