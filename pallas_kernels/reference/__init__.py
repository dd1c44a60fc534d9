"""Plain-JAX (XLA) references of the four Mamba2 state kernels and of paged attention, and the shared semantics.

Everything here runs under ``jax.jit`` on any backend: the Pallas kernels are tested against it, the model
can run on it (``backend="reference"``) and the benchmark measures the kernels against it. Slot
conventions, numerics and the module layout: docs/architecture.md, "Kernel semantics and slot
conventions".
"""

from pallas_kernels.reference.causal_conv1d import causal_conv1d_update_reference, causal_conv1d_varlen_reference
from pallas_kernels.reference.common import slot_usable, take_rows
from pallas_kernels.reference.paged_attention import paged_attention_reference
from pallas_kernels.reference.selective_state_update import (selective_state_update_reference,
                                                             selective_state_update_rows)
from pallas_kernels.reference.ssd import naive_ssm_recurrence, ssd_chunk_metadata, ssd_chunk_scan_varlen_reference

__all__ = [
    "selective_state_update_reference",
    "selective_state_update_rows",
    "causal_conv1d_update_reference",
    "causal_conv1d_varlen_reference",
    "ssd_chunk_scan_varlen_reference",
    "ssd_chunk_metadata",
    "naive_ssm_recurrence",
    "paged_attention_reference",
    "slot_usable",
    "take_rows",
]
