"""``HandoffConnector``: vLLM's own KV-connector hook through which ``VllmDecode`` admits a request whose first
``N-1`` tokens another engine computed (docs/architecture.md, "P/D across frameworks").

vLLM creates the connector itself (``kv_transfer_config`` names this module and class), a scheduler-side and
a worker-side instance, both in this process. ``VllmDecode`` puts each handoff's pages (read over NIXL) in
``PENDING`` under its prompt; the scheduler side reports the prompt's ``N-1`` tokens as matched externally
(synchronously), vLLM allocates the request's Mamba slot and KV blocks, and the worker side writes the pages
into them at the start of the step that computes token ``N`` (after vLLM zeroes new attention blocks, before
the forward), through ``VllmCaches`` and so through vLLM's own block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


@dataclass
class PendingState:
    """One handoff's state to install: ``N-1`` computed tokens, per Mamba layer ``conv (conv_dim, R)`` and
    ``ssm (H, P, N)``, per attention layer ``(2, N-1, K, head_dim)`` token rows."""

    num_computed_tokens: int
    mamba: dict[str, tuple[np.ndarray, np.ndarray]]
    kv: dict[str, np.ndarray]
    #: After the install, the same state read back from vLLM's caches through its block table
    #: (``{"<layer>.conv" | "<layer>.ssm" | "<layer>.kv": array}``, kv as ``(2, N-1, K, head_dim)``).
    installed: dict[str, np.ndarray] | None = None


#: Prompt token ids -> states waiting for vLLM to schedule that prompt (``VllmDecode`` fills it).
PENDING: dict[tuple[int, ...], list[PendingState]] = {}
#: The ``VllmCaches`` the worker side writes through (``VllmDecode`` sets it).
CACHES: list[Any] = []


@dataclass
class _Metadata(KVConnectorMetadata):
    loads: dict[str, PendingState] = field(default_factory=dict)  # vLLM request id -> state


class HandoffConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads ``PENDING`` states into requests vLLM schedules (see the module docstring); saves nothing."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._matched: dict[str, PendingState] = {}  # scheduler side: matched, blocks not allocated yet
        self._loads: dict[str, PendingState] = {}  # scheduler side: allocated, to load this step

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if num_computed_tokens or request.request_id in self._matched:
            return 0, False
        waiting = PENDING.get(tuple(request.prompt_token_ids))
        if not waiting:
            return 0, False
        state = waiting.pop(0)
        self._matched[request.request_id] = state
        return state.num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._matched.pop(request.request_id, None)
        if state is not None and num_external_tokens:
            self._loads[request.request_id] = state

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._loads = _Metadata(self._loads), {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, _Metadata) or not meta.loads:
            return
        caches = CACHES[-1]
        for request_id, state in meta.loads.items():
            slots, blocks = caches.request_state(request_id)
            installed = {}
            for layer, (conv, ssm) in state.mamba.items():
                caches.write_mamba(layer, slots[layer], conv, ssm)
                installed[f"{layer}.conv"], installed[f"{layer}.ssm"] = caches.read_mamba(layer, slots[layer])
            for layer, tokens in state.kv.items():
                caches.write_kv_tokens(layer, blocks[layer], tokens)
                installed[f"{layer}.kv"] = caches.read_kv_tokens(layer, blocks[layer], state.num_computed_tokens)
            state.installed = installed

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are synchronous

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
