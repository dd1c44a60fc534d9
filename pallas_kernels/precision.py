"""How the Triton kernels multiply float32 operands."""

from __future__ import annotations

import jax


def f32_matmul_precision(interpret: bool):
    """How the Triton kernels (the SSD passes' ``mm``, the grouped GEMM) multiply float32 operands.

    Triton's default for a float32 ``dot`` is TF32 (10-bit mantissa): it missed the float32 reference by
    up to 1e-3 on an H100 (2026-11-27). IEEE products (``HIGHEST``) run on the FMA units and took chunk_scan
    to 254-255 registers on sm_90a; 3xTF32 keeps the tensor cores and about float32's accuracy. The
    interpreter runs on XLA's CPU, which has no 3xTF32 and multiplies float32 exactly under ``HIGHEST``."""
    return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
