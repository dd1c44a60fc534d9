"""The bytes a decode step must move, from the config: the memory roofline of a decode step.

A decode step reads every weight once (of the input embedding only its rows' entries: the table is gathered
from, not read whole, unless the LM head shares it), reads and writes each running row's Mamba state (SSM
and conv) in every Mamba layer, and reads each row's KV cache (its context) in every attention layer;
activations, logits and the sampling tail are what a lean step keeps small, so they are not counted.
``plan`` reports a compiled step's bytes (``jaxmamba.hlo_traffic``) beside these; ``bench decode
--roofline`` turns them into milliseconds with a copy bandwidth measured in the same run.

``batch_flops`` is the compute side: the contractions a batch needs (``plan`` reports a mixed bucket's
compiled FLOPs, ``jaxmamba.hlo_flops``, beside those of the batch that fills it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.layout import state_shapes
from jaxmamba.model import HybridForCausalLM
from jaxmamba.pallas_work import BatchShape


@dataclass(frozen=True)
class IdealBytes:
    """A decode step's unavoidable traffic at ``num_reqs`` rows of ``mean_context`` tokens (bytes)."""

    num_reqs: int
    mean_context: int
    weights: int  # every parameter read once, but an untied input embedding table
    embedding: int  # the rows' entries of an untied input embedding table
    ssm_state: int  # read + written, every Mamba layer
    conv_state: int  # read + written, every Mamba layer
    kv: int  # read at the mean context, every attention layer

    @property
    def total(self) -> int:
        return self.weights + self.embedding + self.ssm_state + self.conv_state + self.kv


def kv_bytes_per_token(cfg: HybridConfig, dtype) -> int:
    """K and V of one token in one attention layer."""
    return 2 * max(cfg.num_key_value_heads, 1) * max(cfg.head_dim, 1) * jnp.dtype(dtype).itemsize


def state_row_bytes(cfg: HybridConfig, dtype, ssm_dtype=None) -> tuple[int, int]:
    """``(conv, ssm)`` bytes of one row's state in one Mamba layer."""
    conv, ssm = state_shapes(cfg, 1)
    return (math.prod(conv) * jnp.dtype(dtype).itemsize,
            math.prod(ssm) * jnp.dtype(ssm_dtype or dtype).itemsize)


def weight_bytes(cfg: HybridConfig, dtype) -> int:
    """Bytes of every parameter of the model (abstract: nothing is allocated)."""
    model = nnx.eval_shape(lambda: HybridForCausalLM(cfg, jnp.dtype(dtype)))
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def ideal_decode_bytes(cfg: HybridConfig, num_reqs: int, mean_context: int, dtype, ssm_dtype=None,
                       weights: int | None = None) -> IdealBytes:
    """The bytes a decode step of ``num_reqs`` rows must move (``weights``: every parameter's bytes, when known)."""
    if num_reqs < 1 or mean_context < 1:
        raise ValueError(f"num_reqs={num_reqs} and mean_context={mean_context} must be >= 1")
    conv, ssm = state_row_bytes(cfg, dtype, ssm_dtype)
    mamba = len(cfg.mamba_layer_ids)
    weights = weight_bytes(cfg, dtype) if weights is None else weights
    row = cfg.hidden_size * jnp.dtype(dtype).itemsize
    # An untied embedding table is gathered from: its rows' entries are read, the rest of it is not.
    table, embedding = (0, 0) if cfg.tie_word_embeddings else (cfg.vocab_size * row, num_reqs * row)
    return IdealBytes(
        num_reqs=num_reqs, mean_context=mean_context, weights=weights - table, embedding=embedding,
        ssm_state=2 * num_reqs * mamba * ssm, conv_state=2 * num_reqs * mamba * conv,
        kv=num_reqs * mean_context * len(cfg.attention_layer_ids) * kv_bytes_per_token(cfg, dtype))


def cache_touched_bytes(cfg: HybridConfig, caches, num_reqs: int, mean_context: int, first_parameter: int,
                        dtype) -> dict[int, int]:
    """For ``hlo_traffic.analyze``: the bytes one kernel's access to each cache pool touches in a decode step
    of ``num_reqs`` rows (a Mamba state pool: that many slots; a KV pool: their ``mean_context`` tokens),
    by the entry parameter number of the pool (``caches``' flattened leaves start at ``first_parameter``)."""
    out = {}
    kv_leaves = {id(a) for a in caches.kv}
    per_token = kv_bytes_per_token(cfg, dtype)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(caches)):
        if id(leaf) in kv_leaves:
            out[first_parameter + i] = num_reqs * mean_context * per_token
        else:
            out[first_parameter + i] = num_reqs * math.prod(leaf.shape[1:]) * jnp.dtype(leaf.dtype).itemsize
    return out


def measure_copy_bandwidth(nbytes: int, repeats: int = 5, dtype=jnp.bfloat16) -> float:
    """Bytes per second (read + written) of an elementwise XLA pass over an ``nbytes`` array on jax's default
    device: the copy bandwidth a decode step's roofline is measured against. The fastest of ``repeats``
    timed calls counts (after a warm-up call)."""
    n = max(nbytes // jnp.dtype(dtype).itemsize, 1)
    x = jnp.ones((n,), dtype)
    # x + 1, not a bare copy: XLA may alias or elide a copy; an elementwise pass reads and writes every byte.
    bump = jax.jit(lambda a: a + jnp.asarray(1, dtype))
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n * jnp.dtype(dtype).itemsize / best


def _ffn_flops_per_token(cfg: HybridConfig, kind: str | None, width: int) -> int:
    """A feed-forward block's contractions per token: two matrices (relu2), three (gated, granite's fused pair)."""
    return 2 * cfg.hidden_size * width * (2 if kind == "relu2" else 3)


def _layer_flops_per_token(cfg: HybridConfig) -> int:
    """The projections of every layer, per token (no attention scores, no SSD, no LM head)."""
    d = cfg.hidden_size
    mamba = 2 * d * cfg.mamba_in_proj_size + 2 * cfg.mamba_intermediate_size * d
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = 2 * d * (q + 2 * kv) + 2 * q * d
    ffn_layers = sum(1 for i, k in enumerate(cfg.layer_types)
                     if (k == "mlp" or (cfg.ffn_after_mixer and k != "moe")) and i not in cfg.moe_layer_ids)
    moe = 0
    if cfg.moe_layer_ids:
        moe = (2 * d * cfg.moe_num_experts
               + cfg.moe_top_k * _ffn_flops_per_token(cfg, cfg.moe_expert_kind, cfg.moe_intermediate_size)
               + (_ffn_flops_per_token(cfg, "relu2", cfg.moe_shared_intermediate_size)
                  if cfg.moe_shared_intermediate_size else 0))
    return (len(cfg.mamba_layer_ids) * mamba + len(cfg.attention_layer_ids) * attention
            + ffn_layers * _ffn_flops_per_token(cfg, cfg.mlp_kind, cfg.intermediate_size)
            + len(cfg.moe_layer_ids) * moe)


def ssd_chunk_flops(cfg: HybridConfig, length: int) -> int:
    """One SSD chunk of ``length`` real tokens in one Mamba layer, causal products only: C B^T over the
    lower triangle (per group), its product with x (per head), the chunk's state (B^T x) and the entering
    state read out (C h)."""
    pairs = length * (length + 1) // 2
    h, p, n, g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_d_state, cfg.mamba_n_groups
    return 2 * (pairs * n * g + pairs * p * h + 2 * length * p * n * h)


def batch_flops(cfg: HybridConfig, batch: BatchShape, sampled_rows: int | None = None) -> int:
    """The contractions ``batch`` needs, counting only its real tokens: every layer's projections and
    depthwise convolution taps, the SSD over the prefill rows' real chunks (``ssd_chunk_flops``) and the
    decode rows' state update and read-out, attention scores and values over each token's causal context
    (the cached tokens and its row's earlier new ones), and the LM head over ``sampled_rows`` (default: one a
    row). Elementwise work, norms and softmax are not counted (nor by ``jaxmamba.hlo_flops``)."""
    tokens = batch.num_tokens
    total = tokens * _layer_flops_per_token(cfg)
    mamba = len(cfg.mamba_layer_ids)
    if mamba:
        conv = 2 * cfg.mamba_conv_dim * cfg.mamba_conv_kernel * tokens
        state = 4 * cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_d_state * sum(
            n for n, p in zip(batch.new_tokens, batch.prefill, strict=True) if not p)
        ssd = sum(ssd_chunk_flops(cfg, n) for n in batch.chunk_lengths(cfg.mamba_chunk_size))
        total += mamba * (conv + state + ssd)
    if cfg.attention_layer_ids:
        # Query i of a row attends to computed + i + 1 keys: scores and values, 2 products of head_dim each.
        keys = sum(n * c + n * (n + 1) // 2 for n, c in zip(batch.new_tokens, batch.computed, strict=True))
        total += len(cfg.attention_layer_ids) * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    rows = len(batch.new_tokens) if sampled_rows is None else sampled_rows
    return total + 2 * cfg.hidden_size * cfg.vocab_size * rows
