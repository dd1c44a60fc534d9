"""``pad_to_bucket``: move a built metadata to a larger bucket (real rows unchanged, padding added)."""

from __future__ import annotations

from jaxmamba.errors import MetadataError
from jaxmamba.metadata.checks import parse_bucket, prefill_rows
from jaxmamba.metadata.common_builder import common_rows, pad_common
from jaxmamba.metadata.mamba_builder import mamba_rows, pad_mamba
from jaxmamba.metadata.pytree import CommonAttentionMetadata, MambaMetadata


def pad_to_bucket(metadata, bucket):
    """Move a built metadata (``CommonAttentionMetadata`` or ``MambaMetadata``) to a larger bucket.

    ``bucket`` is ``(num_reqs_padded, num_tokens_padded)`` or, for Mamba
    metadata, ``(num_reqs_padded, num_tokens_padded, num_prefills_padded)``
    (default: ``P = R``). Real rows, tokens and chunks are unchanged; only
    padding is added (and the static chunk count grows with the bucket). Equal
    to building at the larger bucket directly. A bucket smaller than the
    metadata's own raises ``MetadataError``.
    """
    R, T, P = parse_bucket(bucket)
    if metadata.num_reqs_padded > R or metadata.num_tokens_padded > T:
        raise MetadataError(
            f"bucket too small: ({R}, {T}) is smaller than the metadata's bucket "
            f"({metadata.num_reqs_padded}, {metadata.num_tokens_padded})"
        )
    if isinstance(metadata, CommonAttentionMetadata):
        return pad_common(common_rows(metadata), R, T, metadata.block_size, metadata.max_model_len)
    if isinstance(metadata, MambaMetadata):
        P = prefill_rows(P, R)
        if metadata.num_prefills_padded > P:
            raise MetadataError(
                f"bucket too small: num_prefills_padded={P} < the metadata's {metadata.num_prefills_padded}")
        return pad_mamba(
            mamba_rows(metadata),
            R,
            T,
            P,
            metadata.chunk_size,
            metadata.block_size,
            metadata.num_spec,
            metadata.cache_mode,
        )
    raise MetadataError(f"pad_to_bucket: {type(metadata).__name__} is not a metadata pytree")
