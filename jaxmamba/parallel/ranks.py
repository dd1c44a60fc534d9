"""The ``tp`` mesh and what each rank holds: the checks, the rank-local config, and the index maps from the HF
layout to the TP layout (rank-major, each rank's slice vLLM's rank-``r`` tensor). docs/architecture.md,
"Tensor parallelism"."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.layout import extra_groups_for_head_shards, kv_cache_shape
from jaxmamba.parallel.distributed import tp_devices

#: The mesh axis name of tensor parallelism.
TP_AXIS = "tp"


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

    Under the multi-process runtime (``jaxmamba.parallel.distributed``) the global devices: ``tp_size / P`` of
    every process's (``distributed.tp_devices``). With ``cfg``, also checks that the model can be sharded
    ``tp_size`` ways (``validate_tp``).
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
    return Mesh(np.asarray(tp_devices(int(tp_size), devs), dtype=object), (TP_AXIS,))


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
