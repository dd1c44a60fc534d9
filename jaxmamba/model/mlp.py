"""The dense feed-forward block, its own module so that ``layers`` (the blocks) and ``moe`` (shared experts) both
build it without importing each other. Parameters keep torch's ``(out, in)`` orientation, as in ``layers``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.model import ops


def _param(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class MLP(nnx.Module):
    """Feed-forward: ``gated`` (Bamba/FalconH1), ``relu2`` (NemotronH), ``granite`` (fused input_linear)."""

    def __init__(self, cfg: HybridConfig, dtype):
        self.cfg = cfg
        d, f = cfg.hidden_size, cfg.intermediate_size
        granite, gated, bias = cfg.mlp_kind == "granite", cfg.mlp_kind == "gated", cfg.mlp_bias
        # flax.nnx fixes an attribute's data/static status on first assignment: assign each once.
        self.input_linear = _param((2 * f, d), dtype) if granite else None
        self.output_linear = _param((d, f), dtype) if granite else None
        self.gate_proj = _param((f, d), dtype) if gated else None
        self.gate_proj_bias = _param((f,), dtype) if gated and bias else None
        self.up_proj = None if granite else _param((f, d), dtype)
        self.up_proj_bias = _param((f,), dtype) if bias and not granite else None
        self.down_proj = None if granite else _param((d, f), dtype)
        self.down_proj_bias = _param((d,), dtype) if bias and not granite else None

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b = lambda p: None if p is None else p[...]  # noqa: E731
        if cfg.mlp_kind == "granite":
            gate, up = jnp.split(ops.linear(x, self.input_linear[...]), 2, axis=-1)
            return ops.linear(ops.activation(cfg.mlp_activation, gate) * up, self.output_linear[...])
        up = ops.linear(x, self.up_proj[...], b(self.up_proj_bias))
        if cfg.mlp_kind == "relu2":
            return ops.linear(ops.activation(cfg.mlp_activation, up), self.down_proj[...], b(self.down_proj_bias))
        gate_mult, down_mult = cfg.mlp_multipliers
        gate = ops.linear(x, self.gate_proj[...], b(self.gate_proj_bias))
        if gate_mult != 1.0:
            gate = gate * gate_mult
        y = ops.linear(up * ops.activation(cfg.mlp_activation, gate), self.down_proj[...], b(self.down_proj_bias))
        return y * down_mult if down_mult != 1.0 else y
