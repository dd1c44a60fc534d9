"""Tensor parallelism over a ``tp`` mesh axis, with vLLM's per-rank weight and cache layouts.

Parameters are stored once in the TP layout (rank-major, so each device shard is vLLM's rank-``r``
tensor; ``shard_params`` / ``unshard_params``), the model runs inside one ``jax.shard_map``
(``tp_shard_map``) with thin subclasses that add vLLM's collectives, and ``shard_caches`` gives caches
whose shards are vLLM's per-rank pages. What each rank holds and why: docs/architecture.md,
"Tensor parallelism".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmamba.cache import StateCaches, zero_caches
from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError, SlotError
from jaxmamba.layout import extra_groups_for_head_shards, kv_cache_shape, state_shapes
from jaxmamba.model import ops
from jaxmamba.model.hybrid import HybridForCausalLM
from jaxmamba.model.layers import Attention, Mamba2Mixer
from jaxmamba.model.mlp import MLP
from jaxmamba.model.moe import MoE, shared_mlp_config

#: The mesh axis name of tensor parallelism.
TP_AXIS = "tp"

__all__ = [
    "TP_AXIS",
    "validate_tp",
    "make_mesh",
    "mesh_tp_size",
    "local_config",
    "tp_index",
    "mamba_rank_channels",
    "in_proj_index",
    "conv_channel_index",
    "kv_head_index",
    "shard_params",
    "unshard_params",
    "param_specs",
    "local_graphdef",
    "local_model",
    "tp_shard_map",
    "make_tp_forward",
    "tp_forward_logits",
    "tp_prefill",
    "cache_specs",
    "cache_shardings",
    "shard_caches",
    "place_logical_caches",
    "gather_logical_caches",
    "rank_shard",
    "rank_pages",
    "mamba_page_bytes",
    "gather_rank_page",
    "TPMamba2Mixer",
    "TPAttention",
    "TPMLP",
    "TPHybridForCausalLM",
]


# ============================================================================ validation, mesh
def _uses_mlp(cfg: HybridConfig) -> bool:
    return cfg.mlp_kind is not None and (cfg.ffn_after_mixer or "mlp" in cfg.layer_types)


def validate_tp(cfg: HybridConfig, tp_size: int) -> None:
    """Raise ``ConfigError`` naming the config field that ``tp_size`` cannot shard (as vLLM)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise ConfigError(f"tensor_parallel_size={tp_size!r} must be a positive integer")
    tp = int(tp_size)

    def need(ok: bool, name: str, value: Any, why: str) -> None:
        if not ok:
            raise ConfigError(f"{name}={value!r} {why} (tensor_parallel_size={tp})")

    if cfg.mamba_layer_ids:
        need(cfg.mamba_num_heads % tp == 0, "mamba_num_heads", cfg.mamba_num_heads,
             "is not divisible by tensor_parallel_size")
        need(cfg.mamba_intermediate_size % tp == 0, "mamba_intermediate_size", cfg.mamba_intermediate_size,
             "is not divisible by tensor_parallel_size")
        g = cfg.mamba_n_groups
        need(g % tp == 0 or g == 1, "mamba_n_groups", g,
             "is neither divisible by tensor_parallel_size nor 1 (vLLM replicates only a single group)")
        extra_groups_for_head_shards(g, tp)  # the layout contract agrees (raises otherwise)
    if cfg.attention_layer_ids:
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        need(hq % tp == 0, "num_attention_heads", hq, "is not divisible by tensor_parallel_size")
        if tp <= hkv:
            need(hkv % tp == 0, "num_key_value_heads", hkv, "is not divisible by tensor_parallel_size")
        else:
            need(tp % hkv == 0, "num_key_value_heads", hkv,
                 "does not divide tensor_parallel_size (KV heads are replicated only when it does)")
    if _uses_mlp(cfg):
        need(cfg.intermediate_size % tp == 0, "intermediate_size", cfg.intermediate_size,
             "is not divisible by tensor_parallel_size")
    if cfg.moe_layer_ids:
        need(cfg.moe_intermediate_size % tp == 0, "moe_intermediate_size", cfg.moe_intermediate_size,
             "is not divisible by tensor_parallel_size")
        need(cfg.moe_shared_intermediate_size % tp == 0, "moe_shared_expert_intermediate_size",
             cfg.moe_shared_intermediate_size, "is not divisible by tensor_parallel_size")


def make_mesh(tp_size: int, devices: Sequence[jax.Device] | None = None, *, cfg: HybridConfig | None = None) -> Mesh:
    """A 1-D ``Mesh`` with axis ``"tp"`` over the first ``tp_size`` of ``devices`` (default ``jax.devices()``).

    With ``cfg``, also checks that the model can be sharded ``tp_size`` ways (``validate_tp``).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise ConfigError(f"tensor_parallel_size={tp_size!r} must be a positive integer")
    if cfg is not None:
        validate_tp(cfg, int(tp_size))
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < tp_size:
        raise ConfigError(
            f"tensor_parallel_size={tp_size} needs {tp_size} devices but only {len(devs)} "
            f"{'is' if len(devs) == 1 else 'are'} available (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp_size} before jax starts)"
        )
    return Mesh(np.asarray(devs[: int(tp_size)], dtype=object), (TP_AXIS,))


def mesh_tp_size(mesh: Mesh) -> int:
    if TP_AXIS not in mesh.axis_names:
        raise ConfigError(f"mesh axes {mesh.axis_names} have no {TP_AXIS!r} axis")
    return int(mesh.shape[TP_AXIS])


def _groups_tp(cfg: HybridConfig, tp: int) -> int:
    """``G' = G + extra``: the group count after vLLM's replication for head shards."""
    return cfg.mamba_n_groups + extra_groups_for_head_shards(cfg.mamba_n_groups, tp)


def _kv_local(cfg: HybridConfig, tp: int) -> int:
    return kv_cache_shape(1, 1, cfg.num_key_value_heads, 1, tp)[3]


def _vocab_padded(cfg: HybridConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp) * tp


def local_config(cfg: HybridConfig, tp_size: int) -> HybridConfig:
    """The config one rank's modules are built with: every TP-sharded size divided by ``tp_size``.

    Mamba: ``I/tp`` channels, ``H/tp`` heads, ``G'/tp`` B/C groups (``G' = G + extra``, so 1 when
    the single group is replicated); attention: ``Hq/tp`` q heads and the rank's KV heads; MLP
    ``F/tp``; experts ``I/tp`` (and shared experts); vocab ``ceil(V/tp)``. Everything else (hidden size, multipliers, eps) is unchanged.
    """
    validate_tp(cfg, tp_size)
    tp = int(tp_size)
    changes: dict[str, Any] = {"vocab_size": _vocab_padded(cfg, tp) // tp}
    if cfg.mamba_layer_ids:
        changes.update(
            mamba_intermediate_size=cfg.mamba_intermediate_size // tp,
            mamba_num_heads=cfg.mamba_num_heads // tp,
            mamba_n_groups=_groups_tp(cfg, tp) // tp,
        )
    if cfg.attention_layer_ids:
        changes.update(num_attention_heads=cfg.num_attention_heads // tp, num_key_value_heads=_kv_local(cfg, tp))
    if _uses_mlp(cfg):
        changes.update(intermediate_size=cfg.intermediate_size // tp)
    if cfg.moe_layer_ids:
        changes.update(moe_intermediate_size=cfg.moe_intermediate_size // tp,
                       moe_shared_intermediate_size=cfg.moe_shared_intermediate_size // tp)
    return dataclasses.replace(cfg, **changes)


# ============================================================================ index maps
def mamba_rank_channels(cfg: HybridConfig, tp_size: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank ``rank``'s Mamba indices ``(x, bc, heads)``: channels within ``I``, within one of B/C
    (``G*N``, group-major) and heads within ``H`` (vLLM's ``mamba_v2_sharded_weight_loader``)."""
    tp = int(tp_size)
    i, g, n, h = cfg.mamba_intermediate_size, cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_num_heads
    extra_groups_for_head_shards(g, tp)
    groups = range(rank * g // tp, (rank + 1) * g // tp) if g % tp == 0 else range(0, 1)
    x = np.arange(rank * i // tp, (rank + 1) * i // tp)
    bc = np.concatenate([grp * n + np.arange(n) for grp in groups])
    heads = np.arange(rank * h // tp, (rank + 1) * h // tp)
    return x, bc, heads


def in_proj_index(cfg: HybridConfig, tp_size: int) -> np.ndarray:
    """HF ``in_proj`` row of each TP-layout row: rank-major ``[z_r | x_r | B_r | C_r | dt_r]``."""
    i, gn = cfg.mamba_intermediate_size, cfg.mamba_n_groups * cfg.mamba_d_state
    parts = []
    for r in range(tp_size):
        x, bc, heads = mamba_rank_channels(cfg, tp_size, r)
        parts += [x, i + x, 2 * i + bc, 2 * i + gn + bc, 2 * i + 2 * gn + heads]
    return np.concatenate(parts)


def conv_channel_index(cfg: HybridConfig, tp_size: int) -> np.ndarray:
    """Logical conv channel (of ``[x | B | C]``) of each TP-layout channel: rank-major ``[x_r | B_r | C_r]``."""
    i, gn = cfg.mamba_intermediate_size, cfg.mamba_n_groups * cfg.mamba_d_state
    parts = []
    for r in range(tp_size):
        x, bc, _ = mamba_rank_channels(cfg, tp_size, r)
        parts += [x, i + bc, i + gn + bc]
    return np.concatenate(parts)


def kv_head_index(cfg: HybridConfig, tp_size: int) -> np.ndarray:
    """Global KV head of each TP-layout KV head (rank-major; ``physical_head_range`` per rank)."""
    k, tp = cfg.num_key_value_heads, int(tp_size)
    if tp <= k:
        return np.arange(k)
    return np.asarray([r // (tp // k) for r in range(tp)])


def _rows(heads: np.ndarray, size: int) -> np.ndarray:
    return (heads[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def tp_index(cfg: HybridConfig, tp_size: int, path: Sequence[Any]) -> tuple[int | None, np.ndarray | None]:
    """``(axis, index)`` of the parameter at ``path`` (e.g. ``("layers", 0, "mamba", "in_proj")``).

    Its TP layout is ``take(W, index, axis)`` (``-1``: a zero row), sharded over ``"tp"`` on
    ``axis``; ``(None, None)`` means replicated. Raises for a parameter with no rule, so a new
    parameter cannot silently be replicated where vLLM shards it.
    """
    tp = int(tp_size)
    path = tuple(path)
    name = path[-1]
    owner = path[-2] if len(path) >= 2 else None
    cfg_i, cfg_h = cfg.mamba_intermediate_size, cfg.mamba_num_heads
    if path in (("embed",), ("lm_head",)):
        idx = np.arange(_vocab_padded(cfg, tp))
        return 0, np.where(idx < cfg.vocab_size, idx, -1)
    if name == "weight" and owner in ("final_norm", "input_norm", "ffn_norm"):
        return None, None
    if owner == "mamba":
        if name in ("in_proj", "in_proj_bias"):
            return 0, in_proj_index(cfg, tp)
        if name in ("conv_weight", "conv_bias"):
            return 0, conv_channel_index(cfg, tp)
        if name in ("A_log", "D", "dt_bias"):
            return 0, np.arange(cfg_h)
        if name == "norm_weight":
            return 0, np.arange(cfg_i)
        if name == "out_proj":
            return 1, np.arange(cfg_i)
        if name == "out_proj_bias":
            return None, None
    if owner == "attention":
        d = cfg.head_dim
        if name in ("q_proj", "q_proj_bias"):
            return 0, np.arange(cfg.num_attention_heads * d)
        if name in ("k_proj", "v_proj", "k_proj_bias", "v_proj_bias"):
            return 0, _rows(kv_head_index(cfg, tp), d)
        if name == "o_proj":
            return 1, np.arange(cfg.num_attention_heads * d)
        if name == "o_proj_bias":
            return None, None
    if owner == "mlp":
        f = cfg.intermediate_size
        if name in ("gate_proj", "up_proj", "gate_proj_bias", "up_proj_bias"):
            return 0, np.arange(f)
        if name in ("down_proj", "output_linear"):
            return 1, np.arange(f)
        if name == "down_proj_bias":
            return None, None
        if name == "input_linear":  # fused [gate | up] -> rank-major [gate_r | up_r]
            return 0, _fused_gate_up_index(f, tp)
    if owner == "moe":
        if name in ("router", "e_score_correction_bias", "fc1_latent_proj", "fc1_latent_proj_bias",
                    "fc2_latent_proj", "fc2_latent_proj_bias"):
            return None, None
        f = cfg.moe_intermediate_size
        if name == "up_proj":  # (E, U, Dm); SwiGLU's fused [gate | up] -> rank-major [gate_r | up_r]
            return 1, (np.arange(f) if cfg.moe_expert_kind == "relu2" else _fused_gate_up_index(f, tp))
        if name == "down_proj":  # (E, Dm, I)
            return 2, np.arange(f)
    if owner == "shared":  # NemotronH's shared experts: a relu2 MLP
        f = cfg.moe_shared_intermediate_size
        if name in ("up_proj", "up_proj_bias"):
            return 0, np.arange(f)
        if name == "down_proj":
            return 1, np.arange(f)
        if name == "down_proj_bias":
            return None, None
    raise ValueError(f"jaxmamba.parallel has no tensor-parallel rule for parameter {'.'.join(map(str, path))!r}")


def _fused_gate_up_index(f: int, tp: int) -> np.ndarray:
    """Rows of a fused ``[gate (f) | up (f)]`` projection in rank-major ``[gate_r | up_r]`` order
    (vLLM's ``MergedColumnParallelLinear``, and FusedMoE's ``w13``)."""
    per = f // tp
    return np.concatenate([np.concatenate([r * per + np.arange(per), f + r * per + np.arange(per)])
                           for r in range(tp)])


def _spec(axis: int | None, ndim: int) -> P:
    if axis is None:
        return P()
    return P(*([None] * axis + [TP_AXIS] + [None] * (ndim - axis - 1)))


def _take(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    if index.ndim == 1 and index.shape[0] == a.shape[axis] and np.array_equal(index, np.arange(a.shape[axis])):
        return a
    out = np.take(a, np.maximum(index, 0), axis=axis)
    if (index < 0).any():
        shape = [1] * a.ndim
        shape[axis] = index.shape[0]
        out = np.where((index >= 0).reshape(shape), out, np.zeros((), a.dtype))
    return out


def _path_keys(path) -> tuple[Any, ...]:
    keys = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            keys.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            keys.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                keys.append(k.name)
        else:
            keys.append(getattr(k, "key", getattr(k, "name", k)))
    return tuple(keys)


# ============================================================================ parameters
def _as_state(model_or_state) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise TypeError(f"expected a HybridForCausalLM or its nnx.State, got {type(model_or_state).__name__}")


def param_specs(params: nnx.State, cfg: HybridConfig, tp_size: int) -> nnx.State:
    """``PartitionSpec`` of every parameter (same tree as ``params``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _spec(tp_index(cfg, tp_size, _path_keys(path))[0], len(x.shape)), params
    )


def shard_params(model_or_state, cfg: HybridConfig, mesh: Mesh) -> nnx.State:
    """The model's parameters in the TP layout, placed on ``mesh`` with ``NamedSharding``.

    ``model_or_state``: a ``HybridForCausalLM`` or its ``nnx.State`` in the HF layout (as loaded).
    The result has the same tree; device ``r``'s shard of each array is vLLM's rank-``r`` tensor.
    Arrays that vLLM replicates in part (``in_proj`` / conv with ``n_groups = 1 < tp``, K/V with
    ``tp > num_kv_heads``) or pads (vocab) have a larger global shape than the HF tensor.
    """
    tp = mesh_tp_size(mesh)
    validate_tp(cfg, tp)
    state = _as_state(model_or_state)

    def place(path, x):
        axis, index = tp_index(cfg, tp, _path_keys(path))
        host = np.asarray(x)
        if axis is not None:
            host = _take(host, index, axis)
        return jax.device_put(host, NamedSharding(mesh, _spec(axis, host.ndim)))

    return jax.tree_util.tree_map_with_path(place, state)


def unshard_params(tp_params: nnx.State, cfg: HybridConfig, tp_size: int) -> nnx.State:
    """Inverse of ``shard_params``: the HF-layout parameters (host-gathered), e.g. to save a checkpoint.

    HF row ``j`` is read from the first TP-layout position holding it (rank-major order, so
    from the lowest rank that holds a replicated row).
    """

    def gather(path, x):
        axis, index = tp_index(cfg, tp_size, _path_keys(path))
        host = np.asarray(x)
        if axis is None:
            return jnp.asarray(host)
        valid = np.nonzero(index >= 0)[0]
        rows, first = np.unique(index[valid], return_index=True)
        if not np.array_equal(rows, np.arange(rows.shape[0])):
            raise ValueError(f"TP index of {'.'.join(map(str, _path_keys(path)))} does not cover every row")
        return jnp.asarray(np.take(host, valid[first], axis=axis))

    return jax.tree_util.tree_map_with_path(gather, tp_params)


# ============================================================================ rank-local modules
class TPMamba2Mixer(Mamba2Mixer):
    """One rank's Mamba2 mixer (``cfg`` is the local config): vLLM's collectives in ``project_out``.

    ``project_in``, ``split_xbc``, the conv and the SSD are the TP=1 code at local sizes (the
    FalconH1 muP vector too: its five segments shrink with the local config). ``project_out``
    all-reduces the gated RMSNorm's sum of squares when its one group spans ranks
    (``n_groups = 1 < tp``; otherwise each rank's ``G/tp`` norm groups are local), then runs the
    row-parallel ``out_proj``: local matmul, all-reduce, bias once.
    """

    def __init__(self, cfg: HybridConfig, dtype, *, tp_size: int, full_intermediate_size: int, norm_all_reduce: bool):
        super().__init__(cfg, dtype)
        self.tp_size = tp_size
        self.full_intermediate_size = full_intermediate_size
        self.norm_all_reduce = norm_all_reduce

    def project_out(self, y: jax.Array, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        dtype = z.dtype
        if cfg.mamba_gated_norm and self.norm_all_reduce:
            y = _gated_rms_norm_all_reduce(
                y.astype(dtype), z, self.norm_weight[...], full_size=self.full_intermediate_size,
                eps=cfg.mamba_eps, norm_before_gate=cfg.mamba_norm_before_gate,
            )
        elif cfg.mamba_gated_norm:
            y = ops.gated_rms_norm(
                y.astype(dtype), z, self.norm_weight[...], n_groups=cfg.mamba_n_groups,
                eps=cfg.mamba_eps, norm_before_gate=cfg.mamba_norm_before_gate,
            )
        else:
            y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        return _row_parallel(y, self.out_proj[...], self.out_proj_bias)


def _gated_rms_norm_all_reduce(y, gate, weight, *, full_size: int, eps: float, norm_before_gate: bool):
    """``ops.gated_rms_norm`` with one group spanning every rank: the mean square is all-reduced
    (vLLM's ``Mixer2RMSNormGated`` for ``n_groups == 1``, TP > 1)."""
    dtype = y.dtype
    y32 = y.astype(jnp.float32)
    g32 = jax.nn.silu(gate.astype(jnp.float32))
    if not norm_before_gate:
        y32 = y32 * g32
    sum_sq = jax.lax.psum(jnp.sum(jnp.square(y32), axis=-1, keepdims=True), TP_AXIS)
    y32 = y32 * jax.lax.rsqrt(sum_sq / full_size + eps) * weight.astype(jnp.float32)
    if norm_before_gate:
        y32 = y32 * g32
    return y32.astype(dtype)


def _row_parallel(x: jax.Array, weight: jax.Array, bias) -> jax.Array:
    """``RowParallelLinear``: local partial product, all-reduce, then the (replicated) bias once."""
    y = jax.lax.psum(ops.linear(x, weight), TP_AXIS)
    return y if bias is None else y + bias[...].astype(y.dtype)


class TPAttention(Attention):
    """One rank's attention (local q/KV heads); ``o_proj`` is row-parallel."""

    def out(self, attn: jax.Array) -> jax.Array:
        return _row_parallel(attn.reshape(*attn.shape[:-2], -1), self.o_proj[...], self.o_proj_bias)


class TPMLP(MLP):
    """One rank's MLP: column-parallel gate/up (fused ``[gate_r | up_r]`` for Granite), row-parallel down."""

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b = lambda p: None if p is None else p[...]  # noqa: E731
        if cfg.mlp_kind == "granite":
            gate, up = jnp.split(ops.linear(x, self.input_linear[...]), 2, axis=-1)
            return _row_parallel(ops.activation(cfg.mlp_activation, gate) * up, self.output_linear[...], None)
        up = ops.linear(x, self.up_proj[...], b(self.up_proj_bias))
        if cfg.mlp_kind == "relu2":
            return _row_parallel(ops.activation(cfg.mlp_activation, up), self.down_proj[...], self.down_proj_bias)
        gate_mult, down_mult = cfg.mlp_multipliers
        gate = ops.linear(x, self.gate_proj[...], b(self.gate_proj_bias))
        if gate_mult != 1.0:
            gate = gate * gate_mult
        y = _row_parallel(up * ops.activation(cfg.mlp_activation, gate), self.down_proj[...], self.down_proj_bias)
        return y * down_mult if down_mult != 1.0 else y


class TPMoE(MoE):
    """One rank's experts (every expert, ``I/tp`` intermediate channels; vLLM's FusedMoE): routing is
    replicated, and the partial expert outputs are all-reduced before NemotronH's ``fc2_latent_proj``."""

    def reduce(self, partial: jax.Array) -> jax.Array:
        return jax.lax.psum(partial, TP_AXIS)


class TPHybridForCausalLM(HybridForCausalLM):
    """One rank's model: vocab-parallel embedding (masked lookup + all-reduce) and LM head (all-gather)."""

    def __init__(self, cfg: HybridConfig, dtype, *, tp_size: int, full_vocab_size: int):
        super().__init__(cfg, dtype)
        self.tp_size = tp_size
        self.full_vocab_size = full_vocab_size

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        table = self.embed[...]
        rows = table.shape[0]
        local = input_ids - jax.lax.axis_index(TP_AXIS) * rows
        mine = (local >= 0) & (local < rows)
        hidden = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        hidden = jax.lax.psum(jnp.where(mine[..., None], hidden, jnp.zeros((), hidden.dtype)), TP_AXIS)
        m = self.cfg.embedding_multiplier
        return hidden * m if m != 1.0 else hidden

    def logits(self, hidden: jax.Array) -> jax.Array:
        hidden = self.final_norm(hidden)
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        local = ops.linear(hidden, head).astype(jnp.float32)
        logits = _all_gather_last(local, self.tp_size)[..., : self.full_vocab_size]
        m = self.cfg.lm_head_multiplier
        return logits * m if m != 1.0 else logits


def _all_gather_last(x: jax.Array, tp: int) -> jax.Array:
    """All-gather the last axis (rank-major) as an all-reduce of a zero-padded buffer.

    Exact (each element is one rank's value plus zeros) and, unlike ``lax.all_gather``, typed as
    replicated, so ``shard_map``'s ``check_vma`` accepts ``out_specs=P()`` for the logits.
    """
    n = x.shape[-1]
    full = jnp.zeros((*x.shape[:-1], n * tp), x.dtype)
    start = (0,) * (x.ndim - 1) + (jax.lax.axis_index(TP_AXIS) * n,)
    return jax.lax.psum(jax.lax.dynamic_update_slice(full, x, start), TP_AXIS)


def _build_local_model(cfg: HybridConfig, tp: int, dtype) -> TPHybridForCausalLM:
    lc = local_config(cfg, tp)
    model = TPHybridForCausalLM(lc, dtype, tp_size=tp, full_vocab_size=cfg.vocab_size)
    norm_all_reduce = bool(cfg.mamba_layer_ids) and cfg.mamba_n_groups % tp != 0
    for layer in model.layers:
        if layer.mamba is not None:
            layer.mamba = TPMamba2Mixer(lc, dtype, tp_size=tp, full_intermediate_size=cfg.mamba_intermediate_size,
                                        norm_all_reduce=norm_all_reduce)
        if layer.attention is not None:
            layer.attention = TPAttention(lc, dtype)
        if layer.mlp is not None:
            layer.mlp = TPMLP(lc, dtype)
        if layer.moe is not None:
            layer.moe = TPMoE(lc, dtype)
            if layer.moe.shared is not None:
                layer.moe.shared = TPMLP(shared_mlp_config(lc), dtype)
    return model


@functools.lru_cache(maxsize=64)
def _local_graph(cfg: HybridConfig, tp: int, dtype_name: str):
    abstract = nnx.eval_shape(lambda: _build_local_model(cfg, tp, jnp.dtype(dtype_name)))
    graphdef, state = nnx.split(abstract)
    return graphdef, param_specs(state, cfg, tp)


def local_graphdef(cfg: HybridConfig, tp_size: int, dtype=jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, param_specs)`` of the rank-local model: inside ``jax.shard_map(...,
    in_specs=(param_specs, ...))``, ``nnx.merge(graphdef, params)`` on ``shard_params`` output gives
    each device its rank's ``TPHybridForCausalLM`` (for callers that merge themselves, e.g. a step
    function that takes ``(graphdef, params, ...)``)."""
    return _local_graph(cfg, int(tp_size), jnp.dtype(dtype).name)


def local_model(cfg: HybridConfig, tp_size: int, dtype=jnp.float32) -> TPHybridForCausalLM:
    """An abstract (shape-only) rank-local model: what each device runs inside ``tp_shard_map``."""
    return nnx.eval_shape(lambda: _build_local_model(cfg, int(tp_size), jnp.dtype(dtype)))


def _embed_dtype(params: nnx.State):
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if _path_keys(path) == ("embed",):
            return leaf.dtype
    raise ValueError("params have no 'embed' table")


def tp_shard_map(
    fn: Callable[..., Any],
    cfg: HybridConfig,
    mesh: Mesh,
    *,
    dtype=jnp.float32,
    in_specs: Sequence[Any] = (),
    out_specs: Any = P(),
    check_vma: bool = True,
) -> Callable[..., Any]:
    """``jax.shard_map`` of ``fn(local_model, *args)`` over ``mesh``: call the result as ``f(params, *args)``.

    ``params`` is what ``shard_params`` returned (each device receives its vLLM rank's tensors and
    merges them into a ``TPHybridForCausalLM`` built with ``local_config``); ``in_specs`` /
    ``out_specs`` describe ``args`` and the result (``P()``: replicated, ``cache_specs(cfg)`` for
    ``StateCaches``). ``fn`` sees local shapes and may call any model code written for TP=1.

    ``check_vma=True`` (JAX's replication typing) holds for the model's own code; the serving
    step needs ``check_vma=False`` because the kernels' loops start their carries from fresh
    (rank-invariant) zeros and update them with rank-varying values.
    """
    tp = mesh_tp_size(mesh)
    graphdef, pspecs = _local_graph(cfg, tp, jnp.dtype(dtype).name)

    def body(params, *args):
        return fn(nnx.merge(graphdef, params), *args)

    return jax.shard_map(body, mesh=mesh, in_specs=(pspecs, *in_specs), out_specs=out_specs, check_vma=check_vma)


@functools.lru_cache(maxsize=64)
def make_tp_forward(cfg: HybridConfig, mesh: Mesh, dtype=jnp.float32) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """Jitted ``f(params, ids) -> logits``: ``model(ids)`` (hybrid.py's whole-sequence forward) run
    per rank on ``shard_params`` output; ids ``[batch, T]`` and logits are replicated."""
    fwd = tp_shard_map(lambda model, ids: model(ids), cfg, mesh, dtype=dtype, in_specs=(P(),), out_specs=P())
    return jax.jit(fwd)


def tp_forward_logits(model, cfg: HybridConfig, mesh: Mesh, ids) -> jax.Array:
    """Logits of ``model`` (HF layout, unsharded) for ``ids [batch, T]``, computed tensor-parallel on ``mesh``."""
    params = shard_params(model, cfg, mesh)
    return make_tp_forward(cfg, mesh, jnp.dtype(_embed_dtype(params)))(params, jnp.asarray(ids, jnp.int32))


def _prefill_local(model: HybridForCausalLM, ids: jax.Array):
    """Whole-sequence forward that also returns each layer's final state, on whatever sizes ``model`` has."""
    b, t = ids.shape
    conv, ssm, kv = [], [], []

    def run_mamba(mixer, normed):
        mc = mixer.cfg
        z, xbc, dt = mixer.project_in(normed)
        r = mc.mamba_conv_kernel - 1
        hist = jnp.concatenate([jnp.zeros((b, max(r - t, 0), xbc.shape[-1]), xbc.dtype), xbc[:, -r:]], axis=1)
        conv.append(jnp.swapaxes(hist, 1, 2))  # DS: (batch, conv_dim_local, K-1), oldest first
        bias = None if mixer.conv_bias is None else mixer.conv_bias[...]
        xbc = jax.nn.silu(ops.causal_conv1d(xbc, mixer.conv_weight[...], bias))
        x, B, C = mixer.split_xbc(xbc)
        dt = ops.discretize_dt(dt, mixer.dt_bias[...], mc.mamba_time_step_limit)
        y, final = ops.ssd_chunked(x, dt, mixer.A(), B, C, chunk_size=mc.mamba_chunk_size, D=mixer.D[...])
        ssm.append(final)
        return mixer.project_out(y.reshape(b, t, mc.mamba_intermediate_size), z)

    def run_attention(attention, x):
        _, k, v = attention.qkv(x, jnp.broadcast_to(jnp.arange(t), (b, t)))
        kv.append(jnp.stack([k, v]))  # (2, batch, T, kv_local, head_dim): one block of T tokens per row
        return Attention.__call__(attention, x)

    hidden = model.embed_tokens(ids)
    for layer in model.layers:
        hidden = layer(hidden, mamba_fn=run_mamba, attention_fn=run_attention)
    return model.logits(hidden), StateCaches(conv=tuple(conv), ssm=tuple(ssm), kv=tuple(kv))


@functools.lru_cache(maxsize=64)
def _tp_prefill_fn(cfg: HybridConfig, mesh: Mesh, dtype):
    specs = cache_specs(cfg)
    return jax.jit(tp_shard_map(_prefill_local, cfg, mesh, dtype=dtype, in_specs=(P(),), out_specs=(P(), specs)))


def tp_prefill(params: nnx.State, cfg: HybridConfig, mesh: Mesh, ids) -> tuple[jax.Array, StateCaches]:
    """Whole-sequence forward of ``shard_params`` output that also returns the states it leaves.

    Returns ``(logits, caches)`` with ``caches`` in the TP cache layout (global arrays, device
    ``r`` holding rank ``r``'s pages): per Mamba layer conv ``(batch, tp*conv_dim_local, K-1)``
    (the last K-1 pre-conv inputs, DS) and ssm ``(batch, H, P, N)`` (float32), per attention layer
    kv ``(2, batch, T, tp*kv_local, head_dim)``: batch row ``i`` is state slot / KV block ``i``
    (``block_size = T``). This is the state a TP engine holds after prefilling ``ids``.
    """
    return _tp_prefill_fn(cfg, mesh, jnp.dtype(_embed_dtype(params)))(params, jnp.asarray(ids, jnp.int32))


# ============================================================================ caches
def cache_specs(cfg: HybridConfig) -> StateCaches:
    """``PartitionSpec``s of ``StateCaches`` in the TP layout (conv channels, ssm heads, KV heads)."""
    return StateCaches(
        conv=tuple(P(None, TP_AXIS, None) for _ in cfg.mamba_layer_ids),
        ssm=tuple(P(None, TP_AXIS, None, None) for _ in cfg.mamba_layer_ids),
        kv=tuple(P(None, None, None, TP_AXIS, None) for _ in cfg.attention_layer_ids),
    )


def cache_shardings(cfg: HybridConfig, mesh: Mesh) -> StateCaches:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cfg), is_leaf=lambda x: isinstance(x, P))


def shard_caches(
    cfg: HybridConfig,
    mesh: Mesh,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    num_spec: int = 0,
    dtype=jnp.float32,
    ssm_dtype=None,
) -> StateCaches:
    """Zero-filled ``StateCaches`` whose device-``r`` shards are vLLM's rank-``r`` pages.

    Global shapes: conv ``(num_slots, tp*conv_dim_local, K-1+num_spec)`` (rank-major
    ``[x_r|B_r|C_r]``), ssm ``(num_slots, H, P, N)``, kv ``(2, num_blocks, block_size,
    tp*kv_local, head_dim)``; device ``r`` holds ``layout.state_shapes(cfg, tp)`` /
    ``layout.kv_cache_shape(..., tp)`` per slot/block. Slot 0 and block 0 are null (as
    ``cache.allocate_caches``).
    """
    tp = mesh_tp_size(mesh)
    validate_tp(cfg, tp)
    conv_shape = ssm_shape = kv_shape = None
    if cfg.mamba_layer_ids:
        (cl, rows), (hl, p, n) = state_shapes(cfg, tp, num_spec=num_spec)
        conv_shape, ssm_shape = (num_slots, tp * cl, rows), (num_slots, tp * hl, p, n)
    if cfg.attention_layer_ids:
        _, nb, bs, kl, hd = kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, tp)
        kv_shape = (2, nb, bs, tp * kl, hd)
    return zero_caches(cfg, num_slots, num_blocks, conv_shape, ssm_shape, kv_shape, dtype=dtype,
                       ssm_dtype=ssm_dtype, out_shardings=cache_shardings(cfg, mesh))


def place_logical_caches(logical: StateCaches, cfg: HybridConfig, mesh: Mesh) -> StateCaches:
    """TP-layout caches (placed on ``mesh``) holding a TP=1 state: conv ``(slots, I+2GN, R)``,
    ssm ``(slots, H, P, N)``, kv ``(2, blocks, bs, K, hd)`` -> what each rank of a TP engine holds."""
    tp = mesh_tp_size(mesh)
    validate_tp(cfg, tp)
    conv_idx = conv_channel_index(cfg, tp) if cfg.mamba_layer_ids else None
    kv_idx = kv_head_index(cfg, tp) if cfg.attention_layer_ids else None
    sh = cache_shardings(cfg, mesh)
    conv = tuple(jax.device_put(_take(np.asarray(c), conv_idx, 1), s)
                 for c, s in zip(logical.conv, sh.conv, strict=True))
    ssm = tuple(jax.device_put(np.asarray(x), s) for x, s in zip(logical.ssm, sh.ssm, strict=True))
    kv = tuple(jax.device_put(_take(np.asarray(x), kv_idx, 3), s) for x, s in zip(logical.kv, sh.kv, strict=True))
    return StateCaches(conv=conv, ssm=ssm, kv=kv)


def gather_logical_caches(caches: StateCaches, cfg: HybridConfig, tp_size: int) -> StateCaches:
    """Inverse of ``place_logical_caches`` (numpy): replicated channels/heads are read from the lowest rank."""

    def invert(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
        rows, first = np.unique(index, return_index=True)
        assert np.array_equal(rows, np.arange(rows.shape[0]))
        return np.take(a, first, axis=axis)

    conv_idx = conv_channel_index(cfg, tp_size) if cfg.mamba_layer_ids else None
    kv_idx = kv_head_index(cfg, tp_size) if cfg.attention_layer_ids else None
    return StateCaches(
        conv=tuple(invert(np.asarray(c), conv_idx, 1) for c in caches.conv),
        ssm=tuple(np.asarray(x) for x in caches.ssm),
        kv=tuple(invert(np.asarray(x), kv_idx, 3) for x in caches.kv),
    )


def rank_shard(array: jax.Array, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of a TP-layout array, as numpy (the bytes that device holds).

    A replicated or single-device array is the whole array on every rank.
    """
    sharding = getattr(array, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        if rank != 0 and not (sharding is not None and sharding.is_fully_replicated):
            raise ValueError(f"rank {rank}: array is not sharded over a {TP_AXIS!r} mesh")
        return np.asarray(array)
    mesh = sharding.mesh
    tp = mesh_tp_size(mesh)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is out of range for tensor_parallel_size={tp}")
    axis_pos = mesh.axis_names.index(TP_AXIS)
    device = np.asarray(np.moveaxis(np.asarray(mesh.devices), axis_pos, 0)[rank], dtype=object).reshape(-1)[0]
    for shard in array.addressable_shards:
        if shard.device == device:
            return np.asarray(shard.data)
    raise ValueError(f"rank {rank}'s device {device} holds no addressable shard of this array")


def rank_pages(caches: StateCaches, rank: int) -> StateCaches:
    """Rank ``rank``'s caches as numpy: conv ``(slots, conv_dim_local, R)``, ssm ``(slots, H/tp, P, N)``,
    kv ``(2, blocks, bs, kv_local, hd)`` -- exactly vLLM's per-rank cache tensors."""
    return StateCaches(
        conv=tuple(rank_shard(c, rank) for c in caches.conv),
        ssm=tuple(rank_shard(s, rank) for s in caches.ssm),
        kv=tuple(rank_shard(k, rank) for k in caches.kv),
    )


def mamba_page_bytes(conv: np.ndarray, ssm: np.ndarray) -> np.ndarray:
    """``(slots, conv_bytes + ssm_bytes)`` uint8: each slot's vLLM ``MambaSpec`` page (DS conv, then ssm)."""
    slots = conv.shape[0]
    if ssm.shape[0] != slots:
        raise ValueError(f"conv has {slots} slots but ssm has {ssm.shape[0]}")
    conv_b = np.ascontiguousarray(conv).view(np.uint8).reshape(slots, -1)
    ssm_b = np.ascontiguousarray(ssm).view(np.uint8).reshape(slots, -1)
    return np.concatenate([conv_b, ssm_b], axis=1)


def gather_rank_page(caches: StateCaches, rank: int, mamba_layer: int, slot: int) -> np.ndarray:
    """One slot's page (uint8, unpadded) of Mamba layer ``mamba_layer`` (an index into ``caches.conv``)
    on rank ``rank``: the bytes a NIXL READ of that page would return."""
    conv = rank_shard(caches.conv[mamba_layer], rank)
    ssm = rank_shard(caches.ssm[mamba_layer], rank)
    if not 0 <= slot < conv.shape[0]:
        raise SlotError(f"slot {slot} is out of range [0, {conv.shape[0]})")
    return mamba_page_bytes(conv[slot : slot + 1], ssm[slot : slot + 1])[0]
