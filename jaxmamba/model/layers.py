"""Flax NNX modules of the hybrid model (the feed-forward ``MLP`` is ``jaxmamba.model.mlp``'s, the experts
``jaxmamba.model.moe``'s).

Parameters keep torch's orientation (``Linear.weight`` is ``(out, in)``) and
transformers' names where possible, so a jaxmamba parameter can be compared with
its HF tensor without a transpose (``jaxmamba.weights.hf_tensor_specs`` is the
mapping). Modules are built with zero-filled parameters; values come from a
checkpoint.

Each mixer exposes the whole-sequence forward used by ``model(input_ids)``
(``__call__`` on ``[batch, T, hidden]``); the serving step reuses the same
projections through the ``project_in`` / ``project_out`` helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.model import ops
from jaxmamba.model.mlp import MLP
from jaxmamba.model.moe import MoE


def _param(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _param((dim,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.weight[...], self.eps)


def mup_vector(cfg: HybridConfig) -> jax.Array:
    """FalconH1's per-channel multipliers for ``in_proj``'s ``[z | x | B | C | dt]`` outputs."""
    i, gn, h = cfg.mamba_intermediate_size, cfg.mamba_n_groups * cfg.mamba_d_state, cfg.mamba_num_heads
    sizes = (i, i, gn, gn, h)
    return jnp.concatenate([jnp.full((s,), m, jnp.float32) for s, m in zip(sizes, cfg.ssm_multipliers, strict=True)])


class Mamba2Mixer(nnx.Module):
    """Mamba2 mixer: in_proj -> causal conv + SiLU -> SSD -> gated RMSNorm -> out_proj.

    Shapes (H heads of size P, G groups, N state, K conv taps, I = H*P):
      in_proj ``(I + conv_dim + H, hidden)``, conv_weight ``(conv_dim, K)``,
      A_log / D / dt_bias ``(H,)`` (kept in float32), norm_weight ``(I,)``,
      out_proj ``(hidden, I)``; ``conv_dim = I + 2*G*N``.
    """

    def __init__(self, cfg: HybridConfig, dtype):
        self.cfg = cfg
        i, h = cfg.mamba_intermediate_size, cfg.mamba_num_heads
        self.in_proj = _param((cfg.mamba_in_proj_size, cfg.hidden_size), dtype)
        self.in_proj_bias = _param((cfg.mamba_in_proj_size,), dtype) if cfg.mamba_in_proj_bias else None
        self.conv_weight = _param((cfg.mamba_conv_dim, cfg.mamba_conv_kernel), dtype)
        self.conv_bias = _param((cfg.mamba_conv_dim,), dtype) if cfg.mamba_conv_bias else None
        self.A_log = _param((h,), jnp.float32)
        self.D = _param((h,), jnp.float32)
        self.dt_bias = _param((h,), jnp.float32)
        self.norm_weight = _param((i,), dtype) if cfg.mamba_gated_norm else None
        self.out_proj = _param((cfg.hidden_size, i), dtype)
        self.out_proj_bias = _param((cfg.hidden_size,), dtype) if cfg.mamba_out_proj_bias else None

    # The serving path calls these two around its kernels.
    def project_in(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``hidden [..., D] -> (z [..., I], xBC [..., conv_dim], dt [..., H])`` (pre-conv)."""
        cfg = self.cfg
        if cfg.ssm_in_multiplier != 1.0:
            hidden = hidden * cfg.ssm_in_multiplier
        zxbcdt = ops.linear(hidden, self.in_proj[...], None if self.in_proj_bias is None else self.in_proj_bias[...])
        if cfg.family == "falcon_h1":
            zxbcdt = zxbcdt * mup_vector(cfg).astype(zxbcdt.dtype)
        i, c = cfg.mamba_intermediate_size, cfg.mamba_conv_dim
        return zxbcdt[..., :i], zxbcdt[..., i : i + c], zxbcdt[..., i + c :]

    def project_out(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """SSM output ``y [..., I]`` (float32) and gate ``z`` -> mixer output ``[..., D]``."""
        cfg = self.cfg
        dtype = z.dtype
        if cfg.mamba_gated_norm:
            y = ops.gated_rms_norm(
                y.astype(dtype), z, self.norm_weight[...], n_groups=cfg.mamba_n_groups,
                eps=cfg.mamba_eps, norm_before_gate=cfg.mamba_norm_before_gate,
            )
        else:
            y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        return ops.linear(y, self.out_proj[...], None if self.out_proj_bias is None else self.out_proj_bias[...])

    def split_xbc(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Post-conv ``[..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]``."""
        cfg = self.cfg
        i, gn = cfg.mamba_intermediate_size, cfg.mamba_n_groups * cfg.mamba_d_state
        lead = xbc.shape[:-1]
        x = xbc[..., :i].reshape(*lead, cfg.mamba_num_heads, cfg.mamba_head_dim)
        B = xbc[..., i : i + gn].reshape(*lead, cfg.mamba_n_groups, cfg.mamba_d_state)
        C = xbc[..., i + gn :].reshape(*lead, cfg.mamba_n_groups, cfg.mamba_d_state)
        return x, B, C

    def A(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(jnp.float32))

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Whole sequences without a cache: ``hidden [b, T, D] -> [b, T, D]``."""
        cfg = self.cfg
        z, xbc, dt = self.project_in(hidden)
        xbc = jax.nn.silu(
            ops.causal_conv1d(xbc, self.conv_weight[...], None if self.conv_bias is None else self.conv_bias[...])
        )
        x, B, C = self.split_xbc(xbc)
        dt = ops.discretize_dt(dt, self.dt_bias[...], cfg.mamba_time_step_limit)
        y, _ = ops.ssd_chunked(x, dt, self.A(), B, C, chunk_size=cfg.mamba_chunk_size, D=self.D[...])
        y = y.reshape(*y.shape[:-2], cfg.mamba_intermediate_size)
        return self.project_out(y, z)


class Attention(nnx.Module):
    """GQA attention with optional (partial) RoPE; ``q_proj (Hq*d, D)``, ``k/v_proj (Hkv*d, D)``, ``o_proj (D, Hq*d)``."""

    def __init__(self, cfg: HybridConfig, dtype):
        self.cfg = cfg
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = _param((hq * d, cfg.hidden_size), dtype)
        self.k_proj = _param((hkv * d, cfg.hidden_size), dtype)
        self.v_proj = _param((hkv * d, cfg.hidden_size), dtype)
        self.o_proj = _param((cfg.hidden_size, hq * d), dtype)
        bias = cfg.attention_bias
        self.q_proj_bias = _param((hq * d,), dtype) if bias else None
        self.k_proj_bias = _param((hkv * d,), dtype) if bias else None
        self.v_proj_bias = _param((hkv * d,), dtype) if bias else None
        self.o_proj_bias = _param((cfg.hidden_size,), dtype) if bias else None

    @property
    def scale(self) -> float:
        return self.cfg.attention_scale if self.cfg.attention_scale is not None else self.cfg.head_dim ** -0.5

    def _b(self, p):
        return None if p is None else p[...]

    def qkv(self, hidden: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``hidden [..., D]``, ``positions [...]`` -> q ``[..., Hq, d]``, k, v ``[..., Hkv, d]`` (rotated)."""
        cfg = self.cfg
        lead = hidden.shape[:-1]
        q = ops.linear(hidden, self.q_proj[...], self._b(self.q_proj_bias)).reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = ops.linear(hidden, self.k_proj[...], self._b(self.k_proj_bias)).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = ops.linear(hidden, self.v_proj[...], self._b(self.v_proj_bias)).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.key_multiplier != 1.0:
            k = k * cfg.key_multiplier
        if cfg.rope_theta is not None:
            cos, sin = ops.rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
            q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        return q, k, v

    def out(self, attn: jax.Array) -> jax.Array:
        """``attn [..., Hq, d] -> [..., D]``."""
        return ops.linear(attn.reshape(*attn.shape[:-2], -1), self.o_proj[...], self._b(self.o_proj_bias))

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Causal self-attention over whole sequences: ``[b, T, D] -> [b, T, D]``."""
        b, t, _ = hidden.shape
        q, k, v = self.qkv(hidden, jnp.broadcast_to(jnp.arange(t), (b, t)))
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * self.scale
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


class DecoderLayer(nnx.Module):
    """One block. Kinds (``HybridConfig.layer_types``):

    * ``ffn_after_mixer=False`` (Mamba2, NemotronH): ``h += mixer(norm(h))`` where the
      mixer is a Mamba2 mixer, attention, an MLP or a mixture of experts (NemotronH ``moe``).
    * ``ffn_after_mixer=True`` (Bamba, Granite, FalconH1):
      ``h += r * mixer(input_norm(h)); h += r * mlp(ffn_norm(h))`` with ``r`` Granite's
      residual multiplier; FalconH1's ``hybrid`` mixer is
      ``ssm_out * mamba(n) + attn_out * attention(attn_in * n)``. Granite with experts runs
      ``moe(n) + mlp(n)`` (routed experts plus the shared MLP) as the feed-forward.
    """

    def __init__(self, cfg: HybridConfig, kind: str, dtype):
        self.cfg = cfg
        self.kind = kind
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mamba = Mamba2Mixer(cfg, dtype) if kind in ("mamba", "hybrid") else None
        self.attention = Attention(cfg, dtype) if kind in ("attention", "hybrid") else None
        has_ffn = kind == "mlp" or cfg.ffn_after_mixer
        self.mlp = MLP(cfg, dtype) if has_ffn else None
        has_moe = kind == "moe" or (cfg.ffn_after_mixer and cfg.moe_num_experts > 0)
        self.moe = MoE(cfg, dtype) if has_moe else None
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if cfg.ffn_after_mixer else None

    def mix(self, normed: jax.Array, mamba_out: jax.Array | None, attn_out: jax.Array | None) -> jax.Array:
        """Combine the mixer branches' outputs (already computed) into the residual update."""
        cfg = self.cfg
        if self.kind == "hybrid":
            return mamba_out * cfg.ssm_out_multiplier + attn_out * cfg.attention_out_multiplier
        if self.kind == "mamba":
            return mamba_out
        if self.kind == "attention":
            return attn_out
        if self.kind == "moe":
            return self.moe(normed)  # NemotronH "moe" block
        return self.mlp(normed)  # NemotronH "mlp" block

    def ffn(self, hidden: jax.Array) -> jax.Array:
        """Second half of a block (Bamba/Granite/FalconH1); identity elsewhere."""
        if self.ffn_norm is None:
            return hidden
        normed = self.ffn_norm(hidden)
        out = self.mlp(normed) if self.moe is None else self.moe(normed) + self.mlp(normed)
        return hidden + self.cfg.residual_multiplier * out

    def __call__(self, hidden: jax.Array, mamba_fn=None, attention_fn=None) -> jax.Array:
        """``hidden [..., D] -> [..., D]``.

        ``mamba_fn(mixer, normed)`` / ``attention_fn(attention, x)`` replace the
        whole-sequence mixers; the serving step passes functions that read and
        write the state caches, so the block's wiring lives only here.
        """
        cfg = self.cfg
        normed = self.input_norm(hidden)
        mamba_out = attn_out = None
        if self.mamba is not None:
            mamba_out = (mamba_fn or Mamba2Mixer.__call__)(self.mamba, normed)
        if self.attention is not None:
            attn_in = normed * cfg.attention_in_multiplier if cfg.attention_in_multiplier != 1.0 else normed
            attn_out = (attention_fn or Attention.__call__)(self.attention, attn_in)
        hidden = hidden + cfg.residual_multiplier * self.mix(normed, mamba_out, attn_out)
        return self.ffn(hidden)
