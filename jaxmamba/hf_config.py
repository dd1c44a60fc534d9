"""Reading transformers' ``config.json`` for the five supported families into ``HybridConfig``'s fields.

Accepts the files transformers 5.x writes for ``Mamba2ForCausalLM``, ``NemotronHForCausalLM``,
``BambaForCausalLM``, ``GraniteMoeHybridForCausalLM`` and ``FalconH1ForCausalLM``, with every layer-kind
spelling transformers emits (``layers_block_type``, ``hybrid_override_pattern``, ``attn_layer_indices``,
``layer_types``). A missing or malformed field raises ``ConfigError`` naming it; ``HybridConfig.from_hf`` builds
and validates the config from these fields.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from jaxmamba.errors import ConfigError

_ARCH_TO_FAMILY = {
    "Mamba2ForCausalLM": "mamba2",
    "NemotronHForCausalLM": "nemotron_h",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    "FalconH1ForCausalLM": "falcon_h1",
}
_MODEL_TYPE_TO_FAMILY = {
    "mamba2": "mamba2",
    "nemotron_h": "nemotron_h",
    "bamba": "bamba",
    "granitemoehybrid": "granite_hybrid",
    "falcon_h1": "falcon_h1",
}
FAMILY_TO_ARCH = {v: k for k, v in _ARCH_TO_FAMILY.items()}
FAMILY_TO_MODEL_TYPE = {v: k for k, v in _MODEL_TYPE_TO_FAMILY.items()}

# Every spelling of a layer kind that transformers (4.x and 5.x) or vLLM-era configs write.
_KIND_SPELLINGS = {
    "mamba": "mamba",
    "m": "mamba",
    "linear_attention": "mamba",
    "mamba2": "mamba",
    "attention": "attention",
    "*": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "e": "moe",
}


def _parse_float(value: Any, field_name: str) -> float:
    """Floats as transformers serialises them (``{"__float__": "Infinity"}`` for inf)."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name}={value!r} is not a number") from None


def read_config_json(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory, of the file, or the dict itself (copied)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"config.json not found at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def hybrid_config_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``HybridConfig``'s fields from a raw config dict, by the family its architecture or model type names."""
    parser = {
        "mamba2": _parse_mamba2,
        "nemotron_h": _parse_nemotron_h,
        "bamba": _parse_bamba,
        "granite_hybrid": _parse_granite,
        "falcon_h1": _parse_falcon_h1,
    }[_family_of(raw)]
    return parser(_Reader(raw))


class _Reader:
    """Reads fields from a raw HF config dict, raising ``ConfigError`` that names a missing field."""

    def __init__(self, raw: Mapping[str, Any]):
        self.raw = raw

    def get(self, *names: str, default: Any = ...) -> Any:
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                return self.raw[name]
        if default is ...:
            raise ConfigError(f"config field {names[0]!r} is missing")
        return default

    def int(self, *names: str, default: Any = ...) -> int:
        value = self.get(*names, default=default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"{names[0]}={value!r} must be an integer")
        return int(value)

    def float(self, *names: str, default: Any = ...) -> float:
        return _parse_float(self.get(*names, default=default), names[0])

    def bool(self, *names: str, default: Any = ...) -> bool:
        value = self.get(*names, default=default)
        if not isinstance(value, bool):
            raise ConfigError(f"{names[0]}={value!r} must be true or false")
        return value

    def time_step_limit(self) -> tuple[float, float]:
        value = self.get("time_step_limit", default=(0.0, math.inf))
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"time_step_limit={value!r} must be a pair")
        lo, hi = (_parse_float(v, "time_step_limit") for v in value)
        if lo > hi:
            raise ConfigError(f"time_step_limit={value!r} has min > max")
        return lo, hi

    def eos(self) -> tuple[int, ...]:
        value = self.raw.get("eos_token_id")
        if value is None:
            return ()
        return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))

    def rope(self) -> tuple[float, float]:
        """(rope_theta, partial_rotary_factor) from ``rope_parameters`` or the legacy top-level fields."""
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ConfigError(f"rope_parameters={params!r} must be a mapping")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r}: only 'default' RoPE is supported")
        theta = _parse_float(params.get("rope_theta", self.raw.get("rope_theta", 10000.0)), "rope_theta")
        factor = _parse_float(
            params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor", 1.0)), "partial_rotary_factor"
        )
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor={factor} must be in (0, 1]")
        return theta, factor


def _family_of(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in _ARCH_TO_FAMILY:
            return _ARCH_TO_FAMILY[arch]
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPE_TO_FAMILY:
        return _MODEL_TYPE_TO_FAMILY[model_type]
    raise ConfigError(
        f"architectures={archs!r} / model_type={model_type!r} is not a supported family; "
        f"supported architectures: {sorted(_ARCH_TO_FAMILY)}"
    )


def _kinds_from_list(values: Any, field_name: str) -> list[str]:
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"{field_name}={values!r} must be a list")
    kinds = []
    for i, v in enumerate(values):
        kind = _KIND_SPELLINGS.get(str(v).lower())
        if kind is None:
            raise ConfigError(f"{field_name}[{i}]={v!r} is not a known layer kind")
        kinds.append(kind)
    return kinds


def _layer_kinds(r: _Reader, num_layers: int | None) -> list[str]:
    """Layer kinds from whichever spelling the config uses (first one present wins)."""
    if r.raw.get("layers_block_type") is not None:
        kinds = _kinds_from_list(r.raw["layers_block_type"], "layers_block_type")
    elif r.raw.get("hybrid_override_pattern") is not None:
        pattern = r.raw["hybrid_override_pattern"]
        if not isinstance(pattern, str):
            raise ConfigError(f"hybrid_override_pattern={pattern!r} must be a string")
        kinds = _kinds_from_list(list(pattern), "hybrid_override_pattern")
    elif r.raw.get("layer_types") is not None:
        kinds = _kinds_from_list(r.raw["layer_types"], "layer_types")
    elif r.raw.get("attn_layer_indices") is not None:
        if num_layers is None:
            raise ConfigError("num_hidden_layers is missing (needed with attn_layer_indices)")
        indices = r.raw["attn_layer_indices"]
        if not isinstance(indices, (list, tuple)) or any(
            not isinstance(i, int) or not 0 <= i < num_layers for i in indices
        ):
            raise ConfigError(f"attn_layer_indices={indices!r} must be layer indices in [0, {num_layers})")
        kinds = ["attention" if i in set(indices) else "mamba" for i in range(num_layers)]
    else:
        if num_layers is None:
            raise ConfigError("num_hidden_layers is missing")
        kinds = ["mamba"] * num_layers
    if num_layers is not None and len(kinds) != num_layers:
        raise ConfigError(f"num_hidden_layers={num_layers} does not match the {len(kinds)} layer kinds given")
    return kinds


def _mamba_prefixed_fields(r: _Reader, family: str, eps_default: float) -> dict[str, Any]:
    """What Bamba, Granite and FalconH1 spell alike: ``mamba_*`` mixer fields, ``rms_norm_eps``,
    ``hidden_act`` for both the conv and the MLP, attention heads, and an MLP after every mixer."""
    hidden = r.int("hidden_size")
    eps = r.float("rms_norm_eps", default=eps_default)
    act = r.get("hidden_act", default="silu")
    proj_bias = r.bool("mamba_proj_bias", default=False)
    return dict(
        family=family,
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        ffn_after_mixer=True,
        rms_norm_eps=eps,
        tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        mamba_num_heads=r.int("mamba_n_heads"),
        mamba_head_dim=r.int("mamba_d_head"),
        mamba_n_groups=r.int("mamba_n_groups", default=1),
        mamba_d_state=r.int("mamba_d_state"),
        mamba_conv_kernel=r.int("mamba_d_conv", default=4),
        mamba_chunk_size=r.int("mamba_chunk_size", default=256),
        mamba_conv_bias=r.bool("mamba_conv_bias", default=True),
        mamba_in_proj_bias=proj_bias,
        mamba_out_proj_bias=proj_bias,
        mamba_intermediate_size=int(r.float("mamba_expand", default=2) * hidden),
        mamba_time_step_limit=r.time_step_limit(),
        mamba_activation=act,
        mamba_eps=eps,
        **_attention_fields(r, hidden),
        mlp_activation=act,
        eos_token_id=r.eos(),
        max_position_embeddings=r.get("max_position_embeddings", default=None),
        hf_config=r.raw,
    )


def _parse_mamba2(r: _Reader) -> dict[str, Any]:
    hidden = r.int("hidden_size")
    heads = r.int("num_heads")
    head_dim = r.int("head_dim")
    expand = r.float("expand", default=2)
    eps = r.float("layer_norm_epsilon", default=1e-5)
    return dict(
        family="mamba2",
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        layer_types=tuple(_layer_kinds(r, r.int("num_hidden_layers"))),
        ffn_after_mixer=False,
        rms_norm_eps=eps,
        tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        mamba_intermediate_size=int(expand * hidden),
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_n_groups=r.int("n_groups", default=1),
        mamba_d_state=r.int("state_size"),
        mamba_conv_kernel=r.int("conv_kernel", default=4),
        mamba_chunk_size=r.int("chunk_size", default=256),
        mamba_conv_bias=r.bool("use_conv_bias", default=True),
        mamba_in_proj_bias=r.bool("use_bias", default=False),
        mamba_out_proj_bias=r.bool("use_bias", default=False),
        mamba_activation=r.get("hidden_act", default="silu"),
        mamba_time_step_limit=r.time_step_limit(),
        mamba_eps=eps,
        eos_token_id=r.eos(),
        hf_config=r.raw,
    )


def _parse_nemotron_h(r: _Reader) -> dict[str, Any]:
    hidden = r.int("hidden_size")
    num_layers = r.int("num_hidden_layers", default=None) if "num_hidden_layers" in r.raw else None
    kinds = _layer_kinds(r, num_layers)
    eps = r.float("layer_norm_epsilon", default=1e-5)
    heads = r.int("mamba_num_heads")
    head_dim = r.int("mamba_head_dim")
    num_attn = r.int("num_attention_heads", default=0)
    moe = _nemotron_moe_fields(r) if "moe" in kinds else {}
    return dict(
        **moe,
        family="nemotron_h",
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        layer_types=tuple(kinds),
        ffn_after_mixer=False,
        rms_norm_eps=eps,
        tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        # NemotronH sizes the mixer from heads, not from expand.
        mamba_intermediate_size=heads * head_dim,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_n_groups=r.int("n_groups", "mamba_n_groups", default=1),
        mamba_d_state=r.int("ssm_state_size"),
        mamba_conv_kernel=r.int("conv_kernel", "mamba_d_conv", default=4),
        mamba_chunk_size=r.int("chunk_size", "mamba_chunk_size", default=128),
        mamba_conv_bias=r.bool("use_conv_bias", default=True),
        mamba_in_proj_bias=r.bool("use_bias", default=False),
        mamba_out_proj_bias=r.bool("use_bias", default=False),
        mamba_activation=r.get("mamba_hidden_act", default="silu"),
        # transformers' NemotronH mixer clamps dt from below at time_step_min, with no upper limit.
        mamba_time_step_limit=(r.float("time_step_min", default=0.001), math.inf),
        mamba_eps=eps,
        num_attention_heads=num_attn,
        num_key_value_heads=r.int("num_key_value_heads", default=num_attn),
        head_dim=r.int("head_dim", default=hidden // num_attn if num_attn else 0),
        attention_bias=False,  # transformers' NemotronH attention has no bias whatever the config says
        rope_theta=None,
        mlp_kind="relu2" if "mlp" in kinds or moe.get("moe_shared_intermediate_size") else None,
        intermediate_size=r.int("intermediate_size", default=0),
        mlp_activation=r.get("mlp_hidden_act", default="relu2"),
        mlp_bias=r.bool("mlp_bias", default=False),
        eos_token_id=r.eos(),
        max_position_embeddings=r.get("max_position_embeddings", default=None),
        hf_config=r.raw,
    )


def _nemotron_moe_fields(r: _Reader) -> dict[str, Any]:
    """NemotronH ``moe`` blocks (Nemotron-3 Nano): sigmoid-scored grouped top-k routing with a score
    correction bias, relu2 experts, shared experts. Defaults are transformers 5.23's."""
    shared = r.int("n_shared_experts", default=1)
    if shared < 0:
        raise ConfigError(f"n_shared_experts={shared} must be >= 0")
    latent = r.get("moe_latent_size", default=None)
    return dict(
        moe_num_experts=r.int("n_routed_experts", "num_local_experts", default=8),
        moe_top_k=r.int("num_experts_per_tok", default=2),
        moe_intermediate_size=r.int("moe_intermediate_size", default=7688),
        moe_expert_kind="relu2",
        moe_activation=r.get("mlp_hidden_act", default="relu2"),
        moe_scoring="sigmoid",
        moe_n_group=r.int("n_group", default=1),
        moe_topk_group=r.int("topk_group", default=1),
        moe_norm_topk_prob=r.bool("norm_topk_prob", default=True),
        moe_routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
        moe_score_correction_bias=True,
        # transformers builds one shared-expert MLP of this width (n_shared_experts only sizes vLLM's
        # copy, as width * n_shared_experts; both agree for Nemotron-3 Nano's single shared expert).
        moe_shared_intermediate_size=r.int("moe_shared_expert_intermediate_size", default=7688),
        moe_latent_size=None if latent is None else r.int("moe_latent_size"),
    )


def _attention_fields(r: _Reader, hidden: int) -> dict[str, Any]:
    num_attn = r.int("num_attention_heads")
    return dict(
        num_attention_heads=num_attn,
        num_key_value_heads=r.int("num_key_value_heads", default=num_attn),
        head_dim=r.int("head_dim", default=hidden // num_attn),
        attention_bias=r.bool("attention_bias", default=False),
    )


def _parse_bamba(r: _Reader) -> dict[str, Any]:
    theta, factor = r.rope()
    return dict(
        **_mamba_prefixed_fields(r, "bamba", eps_default=1e-5),
        layer_types=tuple(_layer_kinds(r, r.int("num_hidden_layers"))),
        rope_theta=theta,
        partial_rotary_factor=factor,
        mlp_kind="gated",
        intermediate_size=r.int("intermediate_size"),
        mlp_bias=r.bool("mlp_bias", default=False),
    )


def _parse_granite(r: _Reader) -> dict[str, Any]:
    experts = r.int("num_local_experts", default=0)
    if experts < 0:
        raise ConfigError(f"num_local_experts={experts} must be >= 0")
    # Routed experts (block_sparse_moe) beside the shared MLP: softmax over the top-k router logits,
    # SwiGLU experts of width intermediate_size (the shared MLP's is shared_intermediate_size).
    moe = dict(
        moe_num_experts=experts,
        moe_top_k=r.int("num_experts_per_tok", default=2),
        moe_intermediate_size=r.int("intermediate_size", default=11008),
        moe_expert_kind="gated",
        moe_activation=r.get("hidden_act", default="silu"),
        moe_scoring="softmax",
    ) if experts > 0 else {}
    position = r.raw.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ConfigError(f"position_embedding_type={position!r} must be 'rope' or null")
    theta, factor = r.rope() if position == "rope" else (None, 1.0)
    logits_scaling = r.float("logits_scaling", default=1.0)
    if logits_scaling == 0:
        raise ConfigError("logits_scaling=0 would divide the logits by zero")
    return dict(
        **_mamba_prefixed_fields(r, "granite_hybrid", eps_default=1e-6),
        layer_types=tuple(_layer_kinds(r, r.int("num_hidden_layers"))),
        rope_theta=theta,
        partial_rotary_factor=factor,
        attention_scale=r.float("attention_multiplier", default=1.0),
        mlp_kind="granite",
        intermediate_size=r.int("shared_intermediate_size"),
        embedding_multiplier=r.float("embedding_multiplier", default=1.0),
        residual_multiplier=r.float("residual_multiplier", default=1.0),
        lm_head_multiplier=1.0 / logits_scaling,
        **moe,
    )


def _parse_falcon_h1(r: _Reader) -> dict[str, Any]:
    theta, factor = r.rope()
    fields = _mamba_prefixed_fields(r, "falcon_h1", eps_default=1e-5)
    if r.get("mamba_d_ssm", default=None) is not None:
        fields["mamba_intermediate_size"] = r.int("mamba_d_ssm")
    fields["mamba_out_proj_bias"] = r.bool("projectors_bias", default=False)
    ssm_mult = tuple(_parse_float(v, "ssm_multipliers") for v in r.get("ssm_multipliers", default=[1.0] * 5))
    mlp_mult = tuple(_parse_float(v, "mlp_multipliers") for v in r.get("mlp_multipliers", default=[1.0, 1.0]))
    return dict(
        **fields,
        layer_types=("hybrid",) * r.int("num_hidden_layers"),  # every FalconH1 layer runs both mixers
        mamba_gated_norm=r.bool("mamba_rms_norm", default=False),
        mamba_norm_before_gate=r.bool("mamba_norm_before_gate", default=True),
        rope_theta=theta,
        partial_rotary_factor=factor,
        mlp_kind="gated",
        intermediate_size=r.int("intermediate_size"),
        mlp_bias=r.bool("mlp_bias", default=False),
        embedding_multiplier=r.float("embedding_multiplier", default=1.0),
        lm_head_multiplier=r.float("lm_head_multiplier", default=1.0),
        attention_in_multiplier=r.float("attention_in_multiplier", default=1.0),
        attention_out_multiplier=r.float("attention_out_multiplier", default=1.0),
        key_multiplier=r.float("key_multiplier", default=1.0),
        ssm_in_multiplier=r.float("ssm_in_multiplier", default=1.0),
        ssm_out_multiplier=r.float("ssm_out_multiplier", default=1.0),
        ssm_multipliers=ssm_mult,
        mlp_multipliers=mlp_mult,
    )
