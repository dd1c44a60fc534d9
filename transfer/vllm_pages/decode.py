"""``VllmDecode``: vLLM as the decode (D) tier of jaxmamba's P/D contract (docs/architecture.md, "P/D across
frameworks"): ``connect(directories)`` and ``generate(handoffs, ...)`` as jaxmamba's ``DecodeEngine``, so vLLM
continues requests a jaxmamba ``PrefillEngine`` (or a ``VllmPrefill``) computed."""

from __future__ import annotations

from typing import Sequence

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from jaxmamba.errors import ConfigError, TransferError
from transfer.hetero_tp import TransferPlan, TransferShape
from transfer.nixl_bridge import PageDirectory, PageImporter
from transfer.staging import Handoff, StagingPool, close_agents
from transfer.vllm_pages import connector
from transfer.vllm_pages.caches import VllmCaches, cdiv

#: ``kv_transfer_config`` for a ``vllm.LLM`` that ``VllmDecode`` drives.
KV_TRANSFER_CONFIG = {"kv_connector": "HandoffConnector", "kv_connector_module_path": "transfer.vllm_pages.connector",
                      "kv_role": "kv_both"}


class VllmDecode:
    """The D side on a running ``vllm.LLM`` created with ``kv_transfer_config=KV_TRANSFER_CONFIG`` (and as
    ``VllmCaches`` needs: in this process, DS conv layout, no prefix caching).

    ``block_size``: tokens per KV block of the prefill engine's pages (jaxmamba's ``block_size``); its
    pages are READ into a host ``StagingPool`` of a TP=1 jaxmamba engine's layout (the READ byte ranges
    re-shard any P TP size, ``TransferPlan``) and installed into vLLM by ``connector.HandoffConnector``.
    """

    def __init__(self, vllm_llm, *, block_size: int, name: str = "vllm-decode", max_model_len: int | None = None,
                 staging_requests: int = 4, timeout_s: float = 10.0):
        if vllm_llm.llm_engine.vllm_config.kv_transfer_config is None:
            raise ConfigError("VllmDecode needs the LLM created with kv_transfer_config=KV_TRANSFER_CONFIG")
        self.llm, self.name, self.timeout_s, self.block_size = vllm_llm, name, timeout_s, int(block_size)
        self.caches = VllmCaches(vllm_llm)
        connector.CACHES.append(self.caches)
        self.mamba_layers, self.kv_layers = tuple(self.caches.mamba), tuple(self.caches.attention)
        self.shape = self._transfer_shape()
        max_len = int(max_model_len or vllm_llm.llm_engine.model_config.max_model_len)
        n = staging_requests
        self.staging = StagingPool(self.caches.staging_shapes(self.block_size), 1, n + 1,
                                   n * cdiv(max_len, self.block_size) + 1)
        self._importers: dict[str, PageImporter] = {}
        #: Per imported handoff of the last ``generate``: its state as vLLM held it right after the install,
        #: read back through vLLM's block table (``connector.PendingState.installed``).
        self.installed: list[dict] = []

    def _transfer_shape(self) -> TransferShape:
        """The model's page geometry, from vLLM's own cache tensors: conv ``(I + 2*G*N, R)`` and SSM ``(H, P, N)``
        give ``I = H*P``, ``G`` and the conv kernel ``R + 1``; the attention rows give ``(K, head_dim)``."""
        if not self.mamba_layers:
            raise ConfigError("vLLM's model has no Mamba layers: the P/D pages here are those of hybrid Mamba2 models")
        (conv_dim, rows), (heads, head_dim, d_state), conv_dtype, ssm_dtype = self.caches.mamba_shapes(
            self.mamba_layers[0])
        dims = dict(intermediate_size=heads * head_dim, n_groups=(conv_dim - heads * head_dim) // (2 * d_state),
                    d_state=d_state, num_heads=heads, head_dim=head_dim, conv_kernel=rows + 1,
                    conv_dtype_size=conv_dtype.itemsize, ssm_dtype_size=ssm_dtype.itemsize)
        if self.kv_layers:
            (kv_heads, attn_head_dim), kv_dtype = self.caches.kv_token_shape(self.kv_layers[0])
            dims.update(num_kv_heads=kv_heads, attn_head_dim=attn_head_dim, kv_dtype_size=kv_dtype.itemsize)
        return TransferShape(block_size=self.block_size, **dims)

    def connect(self, directories: Sequence[bytes | PageDirectory]) -> str:
        """Connect to one prefill engine's ranks (any TP size); returns its engine id. ``TransferError`` names
        a page that does not fit (dtype, shape, layer count), before anything is read."""
        dirs = [d if isinstance(d, PageDirectory) else PageDirectory.from_bytes(d) for d in directories]
        engine_ids = sorted({d.engine_id for d in dirs})
        if len(engine_ids) != 1:
            raise TransferError(f"connect() takes the directories of exactly one prefill engine, got {engine_ids}")
        engine_id = engine_ids[0]
        importer = PageImporter(f"{self.name}-{engine_id}", TransferPlan(self.shape, dirs[0].tp_size, 1, 0))
        try:
            self.staging.register(importer, 0, self.mamba_layers, self.kv_layers)
            importer.connect(dirs)
        except BaseException:
            importer.close()
            raise
        self._importers[engine_id] = importer
        return engine_id

    def _read(self, handoff: Handoff) -> connector.PendingState:
        """READ one handoff's pages into staging and copy them out as the state the connector installs."""
        importer = self._importers.get(handoff.engine_id)
        if importer is None:
            raise TransferError(f"not connected to prefill engine {handoff.engine_id!r}")
        n = handoff.num_computed_tokens
        num_blocks = cdiv(n, self.block_size) if self.kv_layers else 0
        got = self.staging.allocate(num_blocks)
        if got is None:
            raise TransferError("the staging pool is full")
        slot, blocks = got
        try:
            importer.read_request(handoff.pages, mamba_slots=[slot], kv_blocks=blocks, timeout_s=self.timeout_s,
                                  notif=f"{handoff.handoff_id}|1".encode())  # one D rank reads each P rank
            mamba = {layer: (self.staging.conv[0][i][slot].copy(), self.staging.ssm[0][i][slot].copy())
                     for i, layer in enumerate(self.mamba_layers)}
            kv = {}
            for j, layer in enumerate(self.kv_layers):
                rows = self.staging.kv[0][j][:, blocks]  # (2, num_blocks, block_size, K, head_dim)
                kv[layer] = rows.reshape(2, -1, *rows.shape[3:])[:, :n].copy()
        finally:
            self.staging.free(slot, blocks)
        return connector.PendingState(n, mamba, kv)

    def generate(self, handoffs: Sequence[Handoff | bytes], max_tokens: int) -> list[list[int]]:
        """Greedy-decode ``max_tokens`` tokens of every handoff's prompt, continuing from its imported state (a
        handoff without pages computes its prompt here); token ids per handoff, in order."""
        parsed = [h if isinstance(h, Handoff) else Handoff.from_bytes(h) for h in handoffs]
        states = []
        try:
            for h in parsed:
                if h.pages is not None:
                    state = self._read(h)
                    connector.PENDING.setdefault(tuple(h.prompt_token_ids), []).append(state)
                    states.append(state)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(h.prompt_token_ids)) for h in parsed],
                                        params, use_tqdm=False)
        finally:
            connector.PENDING.clear()
        self.installed = [s.installed for s in states]
        missed = sum(s.installed is None for s in states)
        if missed:
            raise TransferError(f"vLLM scheduled {missed} of {len(states)} imported prompts without their state")
        return [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        importers, self._importers = list(self._importers.values()), {}
        close_agents(importers)
        if self.caches in connector.CACHES:
            connector.CACHES.remove(self.caches)
