"""The rank-local model: subclasses of the model's modules that add vLLM's collectives, built at the local config,
and run inside one ``jax.shard_map`` (``tp_shard_map``) on ``shard_params`` output."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxmamba.cache import StateCaches
from jaxmamba.config import HybridConfig
from jaxmamba.model import ops
from jaxmamba.model.hybrid import HybridForCausalLM
from jaxmamba.model.layers import Attention, Mamba2Mixer
from jaxmamba.model.mlp import MLP
from jaxmamba.model.moe import MoE, shared_mlp_config
from jaxmamba.parallel.caches import cache_specs
from jaxmamba.parallel.params import param_specs, path_keys, shard_params
from jaxmamba.parallel.ranks import TP_AXIS, local_config, mesh_tp_size


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
        if path_keys(path) == ("embed",):
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
