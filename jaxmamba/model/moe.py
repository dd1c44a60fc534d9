"""Mixture-of-experts blocks: NemotronH ``moe`` mixers and Granite's ``block_sparse_moe``.

``route`` (transformers 5.23's softmax and grouped-sigmoid routing), ``grouped_experts`` (the serving
path: sorted rows, grouped matmuls, one compile per bucket whatever the routing) and ``dense_experts``
(the reference). Routing, the grouped methods and the weight layout: docs/architecture.md,
"Mixture of experts".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.model import ops
from jaxmamba.model.mlp import MLP
from pallas_kernels.dispatch import default_interpret
from pallas_kernels.grouped_matmul import grouped_matmul

IMPLEMENTATIONS = ("grouped", "dense")


def route(
    router_logits: jax.Array,
    *,
    top_k: int,
    scoring: str,
    correction_bias: jax.Array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``router_logits float32[T, E]`` -> ``(weights float32[T, k], expert_ids int32[T, k])``."""
    if scoring == "softmax":
        top_logits, ids = jax.lax.top_k(router_logits, top_k)
        return jax.nn.softmax(top_logits, axis=-1), ids.astype(jnp.int32)
    if scoring != "sigmoid":
        raise ValueError(f"scoring={scoring!r} must be 'softmax' or 'sigmoid'")
    t, e = router_logits.shape
    scores = jax.nn.sigmoid(router_logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if n_group > 1:
        per_group = choice.reshape(t, n_group, e // n_group)
        group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)  # [T, n_group]
        _, best_groups = jax.lax.top_k(group_scores, topk_group)
        allowed = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best_groups].set(True)
        choice = jnp.where(jnp.repeat(allowed, e // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)


def _expert_activation(h: jax.Array, kind: str, activation: str) -> jax.Array:
    """``h [..., U] -> [..., I]``: relu2-style ``act(up)`` or SwiGLU ``act(gate) * up`` of a fused ``[gate | up]``."""
    if kind == "gated":
        gate, up = jnp.split(h, 2, axis=-1)
        return ops.activation(activation, gate) * up
    return ops.activation(activation, h)


_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


GROUPED_METHODS = ("ragged_dot", "tiled", "pallas")


def _sort_by_expert(expert_ids: jax.Array, num_experts: int):
    """``(order, group_sizes)``: sorted row ``r`` holds assignment ``order[r]`` of the flattened ``[T*k]`` ids
    (stable, so a token's assignments to one expert stay in slot order); ``group_sizes int32[E]``."""
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    return order, jnp.zeros((num_experts,), jnp.int32).at[flat_ids].add(1)


def _unsort(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Sorted expert outputs ``[T*k, Dm]`` -> ``float32[T, Dm]``, weighted and summed over the k slots.

    A gather by the inverse permutation rather than a scatter-add: deterministic, and a token's k
    contributions are summed in slot order whatever the routing.
    """
    t, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    y = y_sorted[inverse].reshape(t, k, -1).astype(jnp.float32)
    return jnp.sum(y * weights[..., None], axis=1)


def _ragged_dot_experts(rows, group_sizes, up, down, kind, activation):
    h = jax.lax.ragged_dot_general(rows, up.astype(rows.dtype), group_sizes, _RAGGED_DIMS)
    h = _expert_activation(h, kind, activation)
    return jax.lax.ragged_dot_general(h, down.astype(rows.dtype), group_sizes, _RAGGED_DIMS)


def _tile_layout(group_sizes: jax.Array, num_rows: int, tile_rows: int):
    """Where sorted rows go when every group is padded to a multiple of ``tile_rows`` (megablocks' layout).

    Returns ``(dest int32[num_rows], capacity, tile_group int32[capacity / tile_rows], num_tiles int32[])``:
    row ``r`` of the sorted rows sits at ``dest[r]`` of a ``capacity``-row buffer
    (``num_rows + E*(tile_rows-1)`` rounded up: the most any routing needs), tile ``j`` belongs to
    group ``tile_group[j]``, and only the first ``num_tiles`` tiles hold rows.
    """
    e = group_sizes.shape[0]
    padded_sizes = -(-group_sizes // tile_rows) * tile_rows
    starts = jnp.cumsum(group_sizes) - group_sizes
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    capacity = -(-(num_rows + e * (tile_rows - 1)) // tile_rows) * tile_rows
    group_of_row = jnp.repeat(jnp.arange(e), group_sizes, total_repeat_length=num_rows)
    dest = padded_starts[group_of_row] + jnp.arange(num_rows) - starts[group_of_row]
    tile_start = jnp.arange(capacity // tile_rows) * tile_rows
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, tile_start, side="right"), e - 1).astype(jnp.int32)
    return dest, capacity, tile_group, (padded_ends[-1] // tile_rows).astype(jnp.int32)


def _tiled_experts(rows, group_sizes, up, down, kind, activation, tile_rows):
    """Grouped matmuls as a loop over row tiles that each belong to one expert (``_tile_layout``).

    The loop runs only over the tiles in use (a dynamic trip count), so the work is ``~T*k`` rows plus
    at most one partial tile per active expert, and an expert with no token costs nothing.
    """
    n, dm = rows.shape
    dest, capacity, tile_expert, num_tiles = _tile_layout(group_sizes, n, tile_rows)
    buffer = jnp.zeros((capacity, dm), rows.dtype).at[dest].set(rows)
    up, down = up.astype(rows.dtype), down.astype(rows.dtype)

    def body(j, out):
        x = jax.lax.dynamic_slice_in_dim(buffer, j * tile_rows, tile_rows)
        ex = tile_expert[j]
        h = _expert_activation(ops.linear(x, up[ex]), kind, activation)
        return jax.lax.dynamic_update_slice_in_dim(out, ops.linear(h, down[ex]), j * tile_rows, 0)

    out = _like_varying(jnp.zeros((capacity, dm), rows.dtype), up)
    out = jax.lax.fori_loop(0, num_tiles, body, out)
    return out[dest]


def _pallas_experts(rows, group_sizes, up, down, kind, activation, tile_rows, interpret=None):
    """The same tiles through the Pallas grouped GEMM (``pallas_kernels.grouped_matmul``), one launch per
    projection; interpreted on CPU."""
    n, dm = rows.shape
    dest, capacity, tile_expert, num_tiles = _tile_layout(group_sizes, n, tile_rows)
    buffer = jnp.zeros((capacity, dm), rows.dtype).at[dest].set(rows)
    kw = dict(block_m=tile_rows, interpret=default_interpret() if interpret is None else interpret)
    h = grouped_matmul(buffer, up.astype(rows.dtype), tile_expert, num_tiles[None], **kw)
    h = _expert_activation(h, kind, activation)
    return grouped_matmul(h, down.astype(rows.dtype), tile_expert, num_tiles[None], **kw)[dest]


def _like_varying(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed as varying over the same mesh axes as ``like`` (inside ``shard_map``, a loop carry
    that starts as fresh zeros and takes rank-varying expert outputs must be typed varying up front)."""
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; later versions call it ``vma``
    axes = tuple(sorted(mat.varying if mat is not None else getattr(aval, "vma", ())))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


_METHOD_OVERRIDE: contextvars.ContextVar[tuple[str | None, bool | None]] = contextvars.ContextVar(
    "moe_grouped_method", default=(None, None))


@contextlib.contextmanager
def use_grouped_method(method: str | None, interpret: bool | None = None):
    """Trace-time choice of the grouped method for every MoE layer traced inside (``None``: the default).

    The serving step uses it to follow its kernel backend: ``kernel_backend="pallas"`` (the GPU
    default, and what ``plan`` compiles for an H100 on a CPU-only machine) runs the Pallas grouped GEMM;
    ``interpret`` as the step's (``False`` for a GPU target, ``None``: when the backend is the CPU).
    """
    if method is not None and method not in GROUPED_METHODS:
        raise ValueError(f"method={method!r} must be one of {GROUPED_METHODS}")
    token = _METHOD_OVERRIDE.set((method, interpret))
    try:
        yield
    finally:
        _METHOD_OVERRIDE.reset(token)


def default_grouped_method() -> str:
    """``ragged_dot`` on TPU (a native grouped matmul), the Pallas grouped GEMM on GPU, the tiled loop on CPU.

    With jax/XLA 0.10.2 neither XLA:CPU nor XLA:GPU has a grouped GEMM for ``ragged_dot``: CPU expands
    it over every group, and the GPU compiler (checked by compiling for an abstract H100) rewrites it
    into one dense dot contracting over ``E * Dm`` (``E`` times the work and a ``T*k x E*Dm`` operand,
    tens of GB at Nemotron-3-Nano prefill sizes). The tiled forms' memory stays ``O(T*k)``.
    """
    return {"tpu": "ragged_dot", "gpu": "pallas"}.get(jax.default_backend(), "tiled")


def grouped_experts(
    x: jax.Array, weights: jax.Array, expert_ids: jax.Array, up: jax.Array, down: jax.Array, *,
    kind: str, activation: str, method: str | None = None, tile_rows: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Routed experts as grouped matmuls over tokens sorted by expert.

    ``x [T, Dm]``, ``weights float32[T, k]``, ``expert_ids int32[T, k]``, ``up (E, U, Dm)``,
    ``down (E, Dm, I)`` -> ``float32[T, Dm]``: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.
    Every intermediate has a static shape (``T*k`` rows); only the group sizes, counted on the
    device, vary. ``method``: ``"ragged_dot"`` (``jax.lax.ragged_dot_general``), ``"tiled"``
    (``_tiled_experts``), ``"pallas"`` (``_pallas_experts``), or ``None`` for
    ``default_grouped_method()``; ``tile_rows`` (tiled / pallas): 8 / 16 by default (Triton's dot
    needs 16); ``interpret``: the Pallas interpreter (``None``: on CPU).
    """
    ctx_method, ctx_interpret = _METHOD_OVERRIDE.get()
    method = method or ctx_method or default_grouped_method()
    interpret = ctx_interpret if interpret is None else interpret
    if method not in GROUPED_METHODS:
        raise ValueError(f"method={method!r} must be one of {GROUPED_METHODS}")
    _, k = expert_ids.shape
    order, group_sizes = _sort_by_expert(expert_ids, up.shape[0])
    rows = x[order // k]  # [T*k, Dm]
    if method == "ragged_dot":
        y = _ragged_dot_experts(rows, group_sizes, up, down, kind, activation)
    elif method == "tiled":
        y = _tiled_experts(rows, group_sizes, up, down, kind, activation, tile_rows or 8)
    else:
        y = _pallas_experts(rows, group_sizes, up, down, kind, activation, tile_rows or 16, interpret)
    return _unsort(y, order, weights)


def dense_experts(
    x: jax.Array, weights: jax.Array, expert_ids: jax.Array, up: jax.Array, down: jax.Array, *,
    kind: str, activation: str,
) -> jax.Array:
    """Reference for ``grouped_experts`` (same signature): every token through every expert, then masked."""
    t, _ = expert_ids.shape
    num_experts = up.shape[0]
    h = _expert_activation(jnp.einsum("td,eud->etu", x, up.astype(x.dtype)), kind, activation)
    y = jnp.einsum("eti,edi->etd", h, down.astype(x.dtype)).astype(jnp.float32)  # [E, T, Dm]
    combine = jnp.zeros((t, num_experts), jnp.float32).at[jnp.arange(t)[:, None], expert_ids].add(weights)
    return jnp.einsum("te,etd->td", combine, y)


def _param(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def shared_mlp_config(cfg: HybridConfig) -> HybridConfig:
    """The config NemotronH's shared-expert MLP is built from (a relu2 MLP of the shared width)."""
    return dataclasses.replace(cfg, mlp_kind="relu2", intermediate_size=cfg.moe_shared_intermediate_size)


class MoE(nnx.Module):
    """Router + routed experts (+ NemotronH's shared experts and latent projections).

    ``__call__(x [..., D]) -> [..., D]`` in ``x.dtype``. Granite's shared MLP is the block's own
    ``mlp``, not part of this module (its checkpoint names it ``shared_mlp``).
    ``implementation``: ``"grouped"`` (serving) or ``"dense"`` (reference).
    """

    def __init__(self, cfg: HybridConfig, dtype, implementation: str = "grouped"):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
        self.cfg = cfg
        self.implementation = implementation
        e, d, dm, i = cfg.moe_num_experts, cfg.hidden_size, cfg.moe_hidden_size, cfg.moe_intermediate_size
        u = 2 * i if cfg.moe_expert_kind == "gated" else i
        self.router = _param((e, d), dtype)
        self.e_score_correction_bias = _param((e,), jnp.float32) if cfg.moe_score_correction_bias else None
        self.up_proj = _param((e, u, dm), dtype)
        self.down_proj = _param((e, dm, i), dtype)
        latent, bias = cfg.moe_latent_size is not None, cfg.mlp_bias
        self.fc1_latent_proj = _param((dm, d), dtype) if latent else None
        self.fc1_latent_proj_bias = _param((dm,), dtype) if latent and bias else None
        self.fc2_latent_proj = _param((d, dm), dtype) if latent else None
        self.fc2_latent_proj_bias = _param((d,), dtype) if latent and bias else None
        self.shared = MLP(shared_mlp_config(cfg), dtype) if cfg.moe_shared_intermediate_size > 0 else None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, D] -> (weights float32[T, k], expert_ids int32[T, k])``."""
        cfg = self.cfg
        if cfg.moe_scoring == "sigmoid":  # NemotronH: the router runs in float32
            logits = ops.linear(x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        else:  # Granite: in the model dtype, then float32
            logits = ops.linear(x, self.router[...]).astype(jnp.float32)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        weights, ids = route(
            logits, top_k=cfg.moe_top_k, scoring=cfg.moe_scoring, correction_bias=bias, n_group=cfg.moe_n_group,
            topk_group=cfg.moe_topk_group, norm_topk_prob=cfg.moe_norm_topk_prob,
            routed_scaling_factor=cfg.moe_routed_scaling_factor,
        )
        if cfg.moe_scoring == "softmax":  # Granite casts the weights to the hidden dtype
            weights = weights.astype(x.dtype).astype(jnp.float32)
        return weights, ids

    def reduce(self, partial: jax.Array) -> jax.Array:
        """Sum of the ranks' partial expert outputs: the identity on one device (``TPMoE`` all-reduces)."""
        return partial

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat)
        b = lambda p: None if p is None else p[...]  # noqa: E731
        routed_in = flat if self.fc1_latent_proj is None else ops.linear(
            flat, self.fc1_latent_proj[...], b(self.fc1_latent_proj_bias))
        experts = grouped_experts if self.implementation == "grouped" else dense_experts
        routed = experts(routed_in, weights, ids, self.up_proj[...], self.down_proj[...],
                         kind=cfg.moe_expert_kind, activation=cfg.moe_activation)
        routed = self.reduce(routed).astype(x.dtype)
        if self.fc2_latent_proj is not None:
            routed = ops.linear(routed, self.fc2_latent_proj[...], b(self.fc2_latent_proj_bias))
        if self.shared is not None:
            routed = routed + self.shared(flat)
        return routed.reshape(*lead, routed.shape[-1])
