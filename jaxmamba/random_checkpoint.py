"""``random_model``: small deterministic HF-format checkpoints, written without torch.

The embedded default for the CLI, the notebooks and the tests. The config.json
is the one transformers writes for the family, so transformers can load the same
directory (that is how ``python -m jaxmamba compare`` checks us against it).
Weights are drawn from a seeded numpy generator in ``hf_tensor_specs`` order, so
the same (family, size, seed) gives byte-identical files on every machine.
"""

from __future__ import annotations

import functools
import json

import math
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba.config import DEFAULT_FAMILY, FAMILIES, HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.hf_config import FAMILY_TO_ARCH, FAMILY_TO_MODEL_TYPE
from jaxmamba.model import HybridForCausalLM
from jaxmamba.weights import hf_tensor_specs, save_hf

# (hidden, mamba heads, head_dim, d_state, n_groups, layers, attention heads, kv heads, vocab)
SIZES = {
    "tiny": dict(hidden=64, heads=8, head_dim=16, state=16, groups=2, layers=4, attn_heads=4, kv_heads=2, vocab=512),
    "small": dict(hidden=256, heads=16, head_dim=32, state=64, groups=4, layers=8, attn_heads=8, kv_heads=2, vocab=4096),
}


#: Mixture-of-experts checkpoints ``random_model`` also writes: variant name -> (family, layer pattern).
#: NemotronH as Nemotron-3 Nano (``E`` blocks: sigmoid grouped top-k with a score correction bias,
#: relu2 experts, a shared expert); GraniteMoeHybrid as Granite-4.0-H Tiny (softmax top-k, SwiGLU
#: experts beside the shared MLP).
MOE_VARIANTS = {"nemotron_h_moe": "nemotron_h", "granite_hybrid_moe": "granite_hybrid"}
RANDOM_FAMILIES = FAMILIES + tuple(MOE_VARIANTS)

# (routed experts, experts per token, n_group, topk_group, expert width, shared-expert width)
MOE_SIZES = {
    "tiny": dict(experts=8, top_k=2, n_group=2, topk_group=1, width=32, shared=48),
    "small": dict(experts=16, top_k=4, n_group=4, topk_group=2, width=64, shared=128),
}


def _moe_fields(variant: str, size: str) -> dict[str, Any]:
    """The MoE fields transformers 5.23 writes for ``variant`` at ``size``."""
    m, layers = MOE_SIZES[size], SIZES[size]["layers"]
    if variant == "nemotron_h_moe":
        pattern = ("ME*E" if layers <= 4 else "ME*EME-E" * (layers // 8 + 1))[:layers]
        spelled = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
        return dict(
            layers_block_type=[spelled[c] for c in pattern],
            n_routed_experts=m["experts"], num_experts_per_tok=m["top_k"], n_group=m["n_group"],
            topk_group=m["topk_group"], moe_intermediate_size=m["width"], n_shared_experts=1,
            moe_shared_expert_intermediate_size=m["shared"], moe_latent_size=None, moe_shared_expert_overlap=True,
            routed_scaling_factor=2.5, norm_topk_prob=True, output_router_logits=False,
            num_nextn_predict_layers=0, mtp_layers_block_type=["full_attention", "moe"],
        )
    return dict(num_local_experts=m["experts"], num_experts_per_tok=m["top_k"], intermediate_size=m["width"],
                output_router_logits=False, router_aux_loss_coef=0.001)


def _layout(family: str, layers: int) -> dict[str, Any]:
    """Layer-kind fields in the spelling transformers writes for each family."""
    if family == "nemotron_h":
        pattern = ("M*M-" * layers)[:layers]
        spelled = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
        return {"layers_block_type": [spelled[c] for c in pattern]}
    if family == "bamba":
        return {"num_hidden_layers": layers, "attn_layer_indices": list(range(1, layers, 2))}
    if family == "granite_hybrid":
        return {"num_hidden_layers": layers,
                "layer_types": ["full_attention" if i % 2 else "linear_attention" for i in range(layers)]}
    return {"num_hidden_layers": layers}


def random_config_dict(family: str, size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """An HF config.json dict for ``family`` (or a ``MOE_VARIANTS`` name) at ``size``; ``overrides`` replace fields."""
    if family not in RANDOM_FAMILIES:
        raise ConfigError(f"family={family!r} must be one of {RANDOM_FAMILIES}")
    if size not in SIZES:
        raise ConfigError(f"size={size!r} must be one of {sorted(SIZES)}")
    if family in MOE_VARIANTS:
        return random_config_dict(MOE_VARIANTS[family], size, **{**_moe_fields(family, size), **overrides})
    s = SIZES[size]
    base: dict[str, Any] = {
        "architectures": [FAMILY_TO_ARCH[family]],
        "model_type": FAMILY_TO_MODEL_TYPE[family],
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "float32",
        "time_step_limit": [0.0, math.inf],
    }
    mamba_prefixed = {
        "mamba_n_heads": s["heads"], "mamba_d_head": s["head_dim"], "mamba_n_groups": s["groups"],
        "mamba_d_state": s["state"], "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16,
        "mamba_conv_bias": True, "mamba_proj_bias": False,
    }
    attention = {"num_attention_heads": s["attn_heads"], "num_key_value_heads": s["kv_heads"],
                 "head_dim": s["hidden"] // s["attn_heads"], "attention_bias": False, "max_position_embeddings": 4096}
    if family == "mamba2":
        base.update(num_heads=s["heads"], head_dim=s["head_dim"], expand=2, state_size=s["state"],
                    n_groups=s["groups"], conv_kernel=4, chunk_size=16, use_bias=False, use_conv_bias=True,
                    hidden_act="silu", layer_norm_epsilon=1e-5, residual_in_fp32=True,
                    time_step_rank=max(1, s["hidden"] // 16))
    elif family == "nemotron_h":
        base.update(**attention, mamba_num_heads=s["heads"], mamba_head_dim=s["head_dim"], n_groups=s["groups"],
                    ssm_state_size=s["state"], conv_kernel=4, expand=2, chunk_size=16, use_bias=False,
                    use_conv_bias=True, mamba_hidden_act="silu", mlp_hidden_act="relu2", mlp_bias=False,
                    intermediate_size=2 * s["hidden"], layer_norm_epsilon=1e-5, time_step_min=0.001,
                    time_step_max=0.1, time_step_floor=1e-4, mamba_proj_bias=False, residual_in_fp32=False)
    elif family == "bamba":
        base.update(**attention, **mamba_prefixed, intermediate_size=2 * s["hidden"], hidden_act="silu",
                    rms_norm_eps=1e-5, mlp_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    elif family == "granite_hybrid":
        base.update(**attention, **mamba_prefixed, shared_intermediate_size=2 * s["hidden"], hidden_act="silu",
                    rms_norm_eps=1e-6, num_local_experts=0, num_experts_per_tok=2, position_embedding_type="rope",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
                    logits_scaling=2.0)
    elif family == "falcon_h1":
        base.update(**attention, **mamba_prefixed, mamba_d_ssm=s["heads"] * s["head_dim"],
                    intermediate_size=2 * s["hidden"], hidden_act="silu", rms_norm_eps=1e-5, mlp_bias=False,
                    mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    embedding_multiplier=1.5, lm_head_multiplier=0.8, attention_in_multiplier=0.9,
                    attention_out_multiplier=1.1, key_multiplier=0.7, ssm_in_multiplier=1.2,
                    ssm_out_multiplier=0.9, ssm_multipliers=[1.0, 0.8, 1.1, 0.9, 1.2], mlp_multipliers=[1.1, 0.9])
    base.update(_layout(family, s["layers"]))
    base.update(overrides)
    return base


def _init_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], cfg: HybridConfig) -> np.ndarray:
    """Initial values that keep activations O(1) through a few layers, so greedy tokens are well separated."""
    leaf = name.rsplit(".", 2)
    kind = leaf[-2] if leaf[-1] in ("weight", "bias") else leaf[-1]
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith(".D"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("dt_bias"):
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
    if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
        return rng.uniform(-0.1, 0.1, shape).astype(np.float32)
    if "norm" in kind or "layernorm" in kind:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind in ("embeddings", "embed_tokens"):
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "conv1d":
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)


def random_tensors(cfg: HybridConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.hf_name: _init_tensor(rng, s.hf_name, s.hf_shape, cfg) for s in hf_tensor_specs(cfg)}


def random_model(
    family: str = "nemotron_h", size: str = "tiny", seed: int = 0, path: str | Path | None = None, **overrides: Any
) -> Path:
    """Write a deterministic random checkpoint (config.json + model.safetensors); return its directory.

    ``family``: one of ``FAMILIES`` or a ``MOE_VARIANTS`` name (``nemotron_h_moe``,
    ``granite_hybrid_moe``). ``path=None`` writes under a fresh temporary directory. ``overrides`` replace
    config.json fields (e.g. ``mamba_n_groups=1``).
    """
    cfg_dict = random_config_dict(family, size, **overrides)
    cfg = HybridConfig.from_hf(cfg_dict)
    target = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix=f"jaxmamba-{family}-{size}-"))
    save_hf(target, cfg_dict, random_tensors(cfg, seed))
    write_tokenizer(target, cfg_dict["vocab_size"])
    return target


def random_model_of_config(config: str | Path, path: str | Path, seed: int = 0) -> Path:
    """Write a random checkpoint of ``config`` (a config.json, e.g. a real model's) into ``path``.

    For start-up and serving benchmarks at a real model's widths without its weights: the tensors are
    ``random_tensors``' draws (float32 in the file; the engine casts to the config's ``dtype`` on load).
    """
    cfg_dict = json.loads(Path(config).read_text())
    cfg = HybridConfig.from_hf(cfg_dict)
    target = Path(path)
    save_hf(target, cfg_dict, random_tensors(cfg, seed))
    write_tokenizer(target, cfg_dict["vocab_size"])
    return target


#: Text the embedded tokenizer's merges are learnt from (any English does: the model is random).
_CORPUS = """The quick brown fox jumps over the lazy dog. A state space model carries a fixed-size state from
token to token, while attention layers read every earlier token through a paged key-value cache. Hybrid
models interleave the two: most layers are Mamba2 mixers, a few are attention. Serving them needs both
kinds of cache, a scheduler that batches requests continuously, and kernels for prefill and decode.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
Once upon a time there was a little model that wanted to generate text one token at a time.
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 2025 2026 user assistant system: question answer"""

#: Special tokens at ids 0, 1, 2 (pad, bos, eos of ``random_config_dict``).
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|endoftext|>")
#: A minimal chat template, so that the OpenAI server's chat endpoint works on the embedded default.
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def default_checkpoint(family: str = DEFAULT_FAMILY, size: str = "tiny") -> Path:
    """The embedded default: a deterministic random checkpoint, written once under the user cache."""
    path = Path.home() / ".cache" / "jaxmamba" / f"random-{family}-{size}-seed0"
    if not (path / "model.safetensors").exists():
        random_model(family, size=size, seed=0, path=path)
    elif not (path / "tokenizer.json").exists():  # written by a version that shipped no tokenizer
        write_tokenizer(path, json.loads((path / "config.json").read_text())["vocab_size"])
    return path


def write_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A small byte-level BPE (``tokenizer.json``, every id below ``vocab_size``) and a chat template
    (``tokenizer_config.json``) beside a random checkpoint, so text prompts and the server work on it.
    Skipped when ``tokenizers`` is missing (a JAX-only environment)."""
    try:
        text = _tokenizer_json(vocab_size)
    except ImportError:
        return
    path = Path(path)
    (path / "tokenizer.json").write_text(text)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def random_weights(cfg: HybridConfig, dtype="float32", seed: int = 0):
    """A ``HybridForCausalLM`` of ``cfg``'s shape with random weights (no checkpoint written or read: an
    8B-wide layer set is ready in seconds). Scales follow ``_init_tensor``'s (activations O(1)); the draws
    are float32 ones, unlike ``random_tensors``', so tokens differ from ``random_model``'s."""
    abstract = nnx.eval_shape(lambda: HybridForCausalLM(cfg, jnp.dtype(dtype)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    rng = np.random.default_rng(seed)
    values = [jnp.asarray(_random_leaf(rng, jax.tree_util.keystr(path), leaf.shape), leaf.dtype)
              for path, leaf in leaves]
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))


def _random_leaf(rng: np.random.Generator, path: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 draws for the parameter at ``path`` (a ``keystr`` of the model's state)."""
    def uniform(lo, hi):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    if "A_log" in path:
        return np.log(uniform(1.0, 16.0))
    if "'D'" in path:
        return uniform(0.5, 1.5)
    if "dt_bias" in path:
        dt = np.exp(uniform(math.log(1e-3), math.log(1e-1)))
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    value = rng.standard_normal(shape, dtype=np.float32)
    if "norm" in path:
        return 1.0 + 0.1 * value
    if "bias" in path:
        return 0.1 * value
    if "embed" in path:
        return value
    value /= math.sqrt(shape[-1])
    return value
