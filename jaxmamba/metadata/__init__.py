"""Step metadata: host-side numpy builders and JAX pytree dataclasses (docs/architecture.md, "Metadata").

Flow for one step (all on the host, numpy)::

    perm = reorder_batch(query_lens, is_prefilling, seq_lens, decode_threshold=1 + num_spec)
    common = build_common_metadata(num_reqs=..., ..., num_reqs_padded=R, num_tokens_padded=T,
                                   decode_threshold=1 + num_spec)
    mamba = build_mamba_metadata(common, state_indices=..., cache_mode=..., block_size=...,
                                 num_speculative_blocks=num_spec, chunk_size=..., num_slots=...)
    packed = pack(common, mamba)            # one int32 buffer + static layout
    buf = jax.device_put(packed.buffer)     # the step's single metadata transfer
    # inside the jitted step: common, mamba = unpack(buf, layout)

Rules enforced here (docs/architecture.md, "Metadata rules and the bugs they prevent", each with its tests):
1 one-token extends with prior state are Mamba decodes (``mamba_is_prefilling``);
2 the Mamba block table has ``mamba_block_table_columns(...)`` columns and
decodes gather ``1 + num_spec`` slots from the right block; 3 padded rows are
never prefilling and point at no slot; 4 ``max_seq_len`` is the real maximum.
"""

from jaxmamba.metadata.common_builder import build_common_metadata
from jaxmamba.metadata.mamba_builder import (
    CACHE_MODES,
    build_mamba_metadata,
    compute_chunk_metadata,
    mamba_block_table_columns,
    num_chunks_for_bucket,
)
from jaxmamba.metadata.padding import pad_to_bucket
from jaxmamba.metadata.classify import (
    REGION_DECODE,
    REGION_LONG_EXTEND,
    REGION_PREFILL,
    REGION_SHORT_EXTEND,
    all_decode_rows,
    batch_regions,
    check_batch_order,
    mamba_is_prefilling,
    reorder_batch,
    split_decodes_and_prefills,
)
from jaxmamba.metadata.pytree import (
    CacheMode,
    CommonAttentionMetadata,
    FieldSlot,
    MambaMetadata,
    PackedMetadata,
    PackLayout,
    pack,
    to_numpy,
    unpack,
)

__all__ = [
    "CACHE_MODES",
    "CacheMode",
    "REGION_DECODE",
    "REGION_LONG_EXTEND",
    "REGION_PREFILL",
    "REGION_SHORT_EXTEND",
    "CommonAttentionMetadata",
    "FieldSlot",
    "MambaMetadata",
    "PackLayout",
    "PackedMetadata",
    "all_decode_rows",
    "batch_regions",
    "build_common_metadata",
    "build_mamba_metadata",
    "check_batch_order",
    "compute_chunk_metadata",
    "mamba_block_table_columns",
    "mamba_is_prefilling",
    "num_chunks_for_bucket",
    "pack",
    "pad_to_bucket",
    "reorder_batch",
    "split_decodes_and_prefills",
    "to_numpy",
    "unpack",
]
