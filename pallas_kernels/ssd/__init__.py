"""The five passes of the chunked SSD scan (``pallas_kernels.ssd_chunk_scan_varlen`` composes them).

As in vLLM's ``mamba_chunk_scan_combined``, the scan is split so that each
Triton program holds only small tiles (no register spills on sm_90a):

1. ``chunk_cumsum`` -- processed ``dt`` and the stable in-chunk prefix sum of
   ``dA = dt * A``, laid out ``(H, nchunks, chunk_size)``.
2. ``chunk_bmm`` -- ``C B^T`` of every chunk, once per group (shared by the
   ``H // G`` heads of the group), ``(nchunks, G, chunk_size, chunk_size)``.
3. ``chunk_state`` -- each chunk's own contribution to the state at its end.
4. ``state_passing`` -- the sequential recurrence over the real chunks.
5. ``chunk_scan`` -- outputs: intra-chunk quadratic form + decayed entering
   state + ``D x``, gated by ``silu(z)``.

Every ``exp`` argument is a sum of ``dA <= 0`` terms built without differences
of cumulative sums (docs/architecture.md, "SSD numerics").
"""

from pallas_kernels.ssd.bmm import chunk_bmm
from pallas_kernels.ssd.chunk_cumsum import chunk_cumsum
from pallas_kernels.ssd.chunk_scan import chunk_scan
from pallas_kernels.ssd.chunk_state import chunk_state
from pallas_kernels.ssd.state_passing import state_passing

__all__ = ["chunk_bmm", "chunk_cumsum", "chunk_scan", "chunk_state", "state_passing"]
