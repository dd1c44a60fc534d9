"""HybridConfig.from_hf: every family, every layer-kind spelling, and named errors."""

from __future__ import annotations

import math

import pytest

from jaxmamba.config import FAMILIES, HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.random_checkpoint import random_config_dict


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_parses(family):
    cfg = HybridConfig.from_hf(random_config_dict(family))
    assert cfg.family == family
    assert cfg.mamba_layer_ids, "every supported family has Mamba layers"
    assert cfg.mamba_intermediate_size == cfg.mamba_num_heads * cfg.mamba_head_dim


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"layers_block_type": ["mamba", "attention", "mlp"]}, ("mamba", "attention", "mlp")),
        ({"layers_block_type": ["linear_attention", "full_attention", "mlp"]}, ("mamba", "attention", "mlp")),
        ({"hybrid_override_pattern": "M*-M"}, ("mamba", "attention", "mlp", "mamba")),
        ({"layer_types": ["mamba", "attention"]}, ("mamba", "attention")),
        ({"layer_types": ["linear_attention", "full_attention"]}, ("mamba", "attention")),
    ],
)
def test_nemotron_layer_spellings(fields, expected):
    raw = random_config_dict("nemotron_h")
    raw.pop("layers_block_type")
    raw.update(fields)
    assert HybridConfig.from_hf(raw).layer_types == expected


def test_bamba_attn_layer_indices():
    raw = random_config_dict("bamba", num_hidden_layers=5, attn_layer_indices=[0, 3])
    assert HybridConfig.from_hf(raw).layer_types == ("attention", "mamba", "mamba", "attention", "mamba")


def test_granite_layer_types_old_and_new_spelling():
    for spelled in (["mamba", "attention"], ["linear_attention", "full_attention"]):
        raw = random_config_dict("granite_hybrid", num_hidden_layers=2, layer_types=spelled)
        assert HybridConfig.from_hf(raw).layer_types == ("mamba", "attention")


def test_falcon_multipliers_and_infinite_time_step_limit():
    raw = random_config_dict("falcon_h1")
    raw["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    cfg = HybridConfig.from_hf(raw)
    assert cfg.layer_types == ("hybrid",) * 4
    assert cfg.mamba_time_step_limit == (0.0, math.inf)
    assert cfg.ssm_multipliers == (1.0, 0.8, 1.1, 0.9, 1.2)
    assert cfg.key_multiplier == 0.7 and cfg.lm_head_multiplier == 0.8


def test_granite_logits_scaling_becomes_lm_head_multiplier():
    cfg = HybridConfig.from_hf(random_config_dict("granite_hybrid", logits_scaling=4.0))
    assert cfg.lm_head_multiplier == 0.25 and cfg.attention_scale == 0.25


@pytest.mark.parametrize(
    "family,fields,match",
    [
        ("mamba2", {"n_groups": 3}, "mamba_n_groups=3"),
        ("bamba", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ("bamba", {"attn_layer_indices": [9]}, "attn_layer_indices"),
        ("nemotron_h_moe", {"n_group": 3}, "n_group=3"),
        ("nemotron_h_moe", {"topk_group": 3}, "topk_group=3"),
        ("nemotron_h_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
        ("nemotron_h_moe", {"n_routed_experts": 0}, r"layer_types\[1\]=.moe. needs .* n_routed_experts > 0"),
        ("nemotron_h", {"layers_block_type": ["mamba", "conv"]}, r"layers_block_type\[1\]='conv'"),
        ("granite_hybrid_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ("granite_hybrid", {"num_local_experts": -1}, "num_local_experts=-1"),
        ("bamba", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type='yarn'"),
        ("mamba2", {"state_size": None}, "'state_size' is missing"),
        ("mamba2", {"hidden_size": "big"}, "hidden_size='big'"),
        ("falcon_h1", {"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
        ("bamba", {"mamba_d_conv": 1}, "mamba_conv_kernel=1"),
        ("mamba2", {"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
    ],
)
def test_unservable_configs_name_the_field(family, fields, match):
    raw = random_config_dict(family)
    raw.update(fields)
    with pytest.raises(ConfigError, match=match):
        HybridConfig.from_hf(raw)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        HybridConfig.from_hf(tmp_path)


def test_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        HybridConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
