"""Plain-JAX (XLA) references of the four Mamba2 state kernels and of paged attention, and the shared semantics.

Everything here runs under ``jax.jit`` on any backend. The Pallas kernels in this
package are tested against these functions, the model can run on them
(``backend="reference"``), and the benchmark measures the kernels against them.

Slot conventions (DESIGN.md sections 3 and 9), shared by every op:

* A slot index is *usable* when ``NULL_SLOT < index < num_slots`` and
  ``index != pad_slot_id``. ``PAD_SLOT_ID`` (-1, vLLM <= 0.32) and the null slot
  ``0`` (vLLM 0.33's ``null_block_id``) both mean "skip": a skipped source is
  never read (the state starts from zeros instead) and a skipped destination is
  never written. Out-of-range indices are skipped too, so under ``jit`` a bad
  index can never reach memory; outside ``jit`` the public wrappers raise
  ``SlotError`` for them first (interpret mode would otherwise clamp silently).
* Inside kernels an index array holds either a usable slot or ``-1``; the
  wrappers map every skipped entry to ``-1`` and kernels guard on ``>= 0``, so
  ``-1`` is never used as an address.

Numerics follow HuggingFace transformers' Mamba2 torch path and vLLM's kernels:
``dt = softplus(dt + dt_bias)`` (threshold 20), clamped to ``dt_limit``;
``h <- exp(dt*A) h + dt * x B^T``; ``y = h C + D x``; ``y *= silu(z)`` when ``z``
is given. Accumulation is float32; states keep their storage dtype.

Layout: ``common`` (slot conventions, numeric helpers, validation of concrete
index arrays, the stable segment sum), ``selective_state_update``,
``causal_conv1d`` (update and varlen), ``ssd`` (chunk table, chunked scan,
naive float64 recurrence), ``ssd_passes`` (one reference per pass of
``pallas_kernels.ssd``) and ``paged_attention`` (block-by-block online-softmax
attention over vLLM's paged KV layout, for both attention kernels). The Pallas
kernels import their plans and checks from these modules.
"""

from pallas_kernels.reference.causal_conv1d import causal_conv1d_update_reference, causal_conv1d_varlen_reference
from pallas_kernels.reference.common import slot_usable
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
]
