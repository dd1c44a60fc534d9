"""The bytes a decode step must move, from the config: the memory roofline of a decode step.

A decode step reads every weight once (of the input embedding only its rows' entries: the table is gathered
from, not read whole, unless the LM head shares it), reads and writes each running row's Mamba state (SSM
and conv) in every Mamba layer, and reads each row's KV cache (its context) in every attention layer;
activations, logits and the sampling tail are what a lean step keeps small, so they are not counted.
``plan`` reports a compiled step's bytes (``jaxmamba.hlo_traffic``) beside these; ``bench decode
--roofline`` turns them into milliseconds with a copy bandwidth measured in the same run.
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
