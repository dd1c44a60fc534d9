"""P/D disaggregation across TP sizes: split plans and the NIXL bridge (docs/architecture.md, "P/D transfer
across TP sizes" and Rule 5).

* ``transfer.conv_split``: ``ConvSplit`` (vLLM's ``MambaConvSplitInfo``): x/B/C byte ranges of a
  DS conv-state page, locally and inside a P page for a signed TP ratio.
* ``transfer.hetero_tp``: ``physical_head_range``, ``TransferShape``, ``TransferPlan`` (which P
  ranks a D rank reads, and the exact byte ranges per Mamba slot and per KV block).
* ``transfer.pages``: a numpy model of per-rank pages built from TP=1 states (the independent
  checker), and a synthetic prefill engine process for tests and benchmarks.
* ``transfer.nixl_bridge``: ``PageExporter`` / ``PageImporter`` over real NIXL agents (UCX); the agents
  and their pages are ``transfer.nixl_agent``'s, the D side's reads ``transfer.nixl_import``'s.
  NIXL itself is imported only when an agent is created.
"""

from transfer.conv_split import ConvSplit
from transfer.hetero_tp import (
    ByteRange,
    TransferPlan,
    TransferShape,
    mamba_read_targets,
    physical_head_range,
    signed_tp_ratio,
)

__all__ = [
    "ByteRange",
    "ConvSplit",
    "TransferPlan",
    "TransferShape",
    "mamba_read_targets",
    "physical_head_range",
    "signed_tp_ratio",
]
