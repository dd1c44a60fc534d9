"""``HybridForCausalLM``: embedding -> decoder layers -> final norm -> LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.errors import RequestError
from jaxmamba.model import ops
from jaxmamba.model.layers import DecoderLayer, RMSNorm


class HybridForCausalLM(nnx.Module):
    """A hybrid Mamba2/attention language model of any supported family.

    ``model(input_ids)`` with int32 ``[batch, T]`` returns float ``[batch, T, vocab]``
    logits for whole sequences without a cache (the research entry point).
    """

    def __init__(self, cfg: HybridConfig, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype) for kind in cfg.layer_types])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        hidden = jnp.take(self.embed[...], input_ids, axis=0)
        m = self.cfg.embedding_multiplier
        return hidden * m if m != 1.0 else hidden

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: ``[..., D] -> [..., V]`` in float32."""
        hidden = self.final_norm(hidden)
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        logits = ops.linear(hidden, head).astype(jnp.float32)
        m = self.cfg.lm_head_multiplier
        return logits * m if m != 1.0 else logits

    def hidden_states(self, input_ids: jax.Array) -> list[jax.Array]:
        """Residual stream after the embedding and after every layer (for per-layer comparison)."""
        hidden = self.embed_tokens(input_ids)
        out = [hidden]
        for layer in self.layers:
            hidden = layer(hidden)
            out.append(hidden)
        return out

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise RequestError(f"input_ids must be [batch, T], got shape {input_ids.shape}")
        return self.logits(self.hidden_states(input_ids)[-1])
