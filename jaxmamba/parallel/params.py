"""The model's parameters in the TP layout: their ``PartitionSpec``s, ``shard_params`` (HF layout -> placed on the
mesh) and ``unshard_params`` (back)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmamba.config import HybridConfig
from jaxmamba.parallel.distributed import device_put_global
from jaxmamba.parallel.ranks import TP_AXIS, mesh_tp_size, tp_index, validate_tp


def partition_spec(axis: int | None, ndim: int) -> P:
    """Sharded over ``"tp"`` on ``axis`` (None: replicated)."""
    if axis is None:
        return P()
    return P(*([None] * axis + [TP_AXIS] + [None] * (ndim - axis - 1)))


def take_layout(a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """``a`` in the TP layout along ``axis``: ``take(a, index)`` with a zero row where ``index`` is -1."""
    if index.ndim == 1 and index.shape[0] == a.shape[axis] and np.array_equal(index, np.arange(a.shape[axis])):
        return a
    out = np.take(a, np.maximum(index, 0), axis=axis)
    if (index < 0).any():
        shape = [1] * a.ndim
        shape[axis] = index.shape[0]
        out = np.where((index >= 0).reshape(shape), out, np.zeros((), a.dtype))
    return out


def path_keys(path) -> tuple[Any, ...]:
    """The plain keys of a ``jax.tree_util`` key path (``("layers", 0, "mamba", "in_proj")``), as ``tp_index`` takes."""
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


def _as_state(model_or_state) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise TypeError(f"expected a HybridForCausalLM or its nnx.State, got {type(model_or_state).__name__}")


def param_specs(params: nnx.State, cfg: HybridConfig, tp_size: int) -> nnx.State:
    """``PartitionSpec`` of every parameter (same tree as ``params``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: partition_spec(tp_index(cfg, tp_size, path_keys(path))[0], len(x.shape)), params
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
        axis, index = tp_index(cfg, tp, path_keys(path))
        host = np.asarray(x)
        if axis is not None:
            host = take_layout(host, index, axis)
        return device_put_global(host, NamedSharding(mesh, partition_spec(axis, host.ndim)))

    return jax.tree_util.tree_map_with_path(place, state)


def unshard_params(tp_params: nnx.State, cfg: HybridConfig, tp_size: int) -> nnx.State:
    """Inverse of ``shard_params``: the HF-layout parameters (host-gathered), e.g. to save a checkpoint.

    HF row ``j`` is read from the first TP-layout position holding it (rank-major order, so
    from the lowest rank that holds a replicated row).
    """

    def gather(path, x):
        axis, index = tp_index(cfg, tp_size, path_keys(path))
        host = np.asarray(x)
        if axis is None:
            return jnp.asarray(host)
        valid = np.nonzero(index >= 0)[0]
        rows, first = np.unique(index[valid], return_index=True)
        if not np.array_equal(rows, np.arange(rows.shape[0])):
            raise ValueError(f"TP index of {'.'.join(map(str, path_keys(path)))} does not cover every row")
        return jnp.asarray(np.take(host, valid[first], axis=axis))

    return jax.tree_util.tree_map_with_path(gather, tp_params)
