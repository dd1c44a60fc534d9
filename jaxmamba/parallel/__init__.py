"""Tensor parallelism over a ``tp`` mesh axis, with vLLM's per-rank weight and cache layouts.

Parameters are stored once in the TP layout (rank-major, so each device shard is vLLM's rank-``r``
tensor; ``shard_params`` / ``unshard_params``), the model runs inside one ``jax.shard_map``
(``tp_shard_map``) with thin subclasses that add vLLM's collectives, and ``shard_caches`` gives caches
whose shards are vLLM's per-rank pages. What each rank holds and why: docs/architecture.md,
"Tensor parallelism".
"""

from jaxmamba.parallel.caches import (cache_shardings, cache_specs, gather_logical_caches, gather_rank_page,
                                      mamba_page_bytes, place_logical_caches, rank_pages, rank_shard, shard_caches)
from jaxmamba.parallel.model import (TPMLP, TPAttention, TPHybridForCausalLM, TPMamba2Mixer, TPMoE, local_graphdef,
                                     local_model, make_tp_forward, tp_forward_logits, tp_prefill, tp_shard_map)
from jaxmamba.parallel.params import param_specs, path_keys, shard_params, unshard_params
from jaxmamba.parallel.ranks import (TP_AXIS, conv_channel_index, in_proj_index, kv_head_index, local_config,
                                     make_mesh, mamba_rank_channels, mesh_tp_size, tp_index, validate_tp)

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
    "TPMoE",
    "path_keys",
]

