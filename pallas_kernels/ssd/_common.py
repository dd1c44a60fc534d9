"""Helpers shared by the SSD passes (chunk bounds, float32-accumulating matmul)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


F32 = jnp.float32


def chunk_bounds(cc_ref, c, chunk_size):
    """``(first token, length)`` of chunk ``c`` from the ``cu_chunk_seqlens`` ref."""
    start = cc_ref[c]
    return start, jnp.clip(cc_ref[c + 1] - start, 0, chunk_size)


def mm(a, b, contract, mm_dtype, *, f32_precision, exact=None):
    """2-D matmul with float32 accumulation; operands cast to ``mm_dtype``.

    ``exact`` (default: the operands are float32) multiplies at ``f32_precision``
    (``f32_matmul_precision``) instead of Triton's TF32 default. Float32 products inside a 2-byte kernel
    (C·state) pass ``exact=False``: TF32 there is finer than mamba_ssm's cast of the state to the input
    dtype, and anything more cost the bf16 scan 2.4x on the H100. 2-byte operands are exact on the tensor
    cores either way."""
    exact = jnp.dtype(mm_dtype) == F32 if exact is None else exact
    return jax.lax.dot_general(a.astype(mm_dtype), b.astype(mm_dtype), (contract, ((), ())),
                               preferred_element_type=F32, precision=f32_precision if exact else None)


def matmul_dtype(dtype):
    """Operand dtype of the tensor-core matmuls: 2-byte inputs stay as they are, else float32."""
    return dtype if jnp.dtype(dtype).itemsize == 2 else F32


def check_block(name: str, value: int, lo: int = 1) -> int:
    value = int(value)
    if value < lo or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of 2 >= {lo}")
    return value
