"""The whole-sequence model against transformers, for all five families."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from hf_reference import hf_checkpoint, hf_logits  # noqa: E402
from jaxmamba import load_pretrained  # noqa: E402
from jaxmamba.config import FAMILIES  # noqa: E402

# Group-count override field per family (n_groups must divide the 8 tiny heads).
GROUP_FIELD = {"mamba2": "n_groups", "nemotron_h": "n_groups"}

# Variants that exercise family-specific options beyond the defaults.
VARIANTS = [
    ("mamba2", {"tie_word_embeddings": True}),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"]}),
    ("bamba", {"attention_bias": True, "mlp_bias": True, "mamba_proj_bias": True}),
    ("granite_hybrid", {"position_embedding_type": None}),
    ("falcon_h1", {"mamba_rms_norm": False}),
    ("falcon_h1", {"mamba_norm_before_gate": True}),
]


def _check_close(path, batch=2, seq=37, seed=1):
    # 37 tokens: not a multiple of the chunk size (16), so the SSD tail chunk is exercised.
    ids = np.random.default_rng(seed).integers(0, 512, size=(batch, seq)).astype(np.int32)
    ref = hf_logits(path, ids)
    ours = np.asarray(load_pretrained(path)(jnp.asarray(ids)))
    scale = np.abs(ref).max()
    assert scale > 0.5, "reference logits are degenerate; the comparison would prove nothing"
    err = np.abs(ours - ref).max() / scale
    assert err < 1e-4, f"max |Δlogit| / scale = {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_logits_match_transformers(tmp_path, family, n_groups):
    field = GROUP_FIELD.get(family, "mamba_n_groups")
    _check_close(hf_checkpoint(tmp_path, family, **{field: n_groups}))


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=[f"{f}-{'-'.join(o)}" for f, o in VARIANTS])
def test_family_variants_match_transformers(tmp_path, family, overrides):
    _check_close(hf_checkpoint(tmp_path, family, **overrides), batch=3, seq=21)


def test_nemotron_legacy_hybrid_override_pattern(tmp_path):
    """A vLLM-era config spelling the layers as a pattern string loads to the same model."""
    import json

    path = hf_checkpoint(tmp_path, "nemotron_h")
    cfg = json.loads((path / "config.json").read_text())
    spelled = {"linear_attention": "M", "full_attention": "*", "mlp": "-"}
    cfg["hybrid_override_pattern"] = "".join(spelled[k] for k in cfg.pop("layers_block_type"))
    (path / "config.json").write_text(json.dumps(cfg))
    from jaxmamba.config import HybridConfig

    assert HybridConfig.from_hf(path).layer_types == ("mamba", "attention", "mamba", "mlp")
    ids = np.arange(20, dtype=np.int32)[None]
    assert np.allclose(np.asarray(load_pretrained(path)(jnp.asarray(ids))), hf_logits(
        hf_checkpoint(tmp_path / "orig", "nemotron_h"), ids), atol=1e-4)


def test_bf16_checkpoint_loads_in_f32_and_bf16(tmp_path):
    path = hf_checkpoint(tmp_path, "bamba", dtype="bfloat16")
    ids = np.random.default_rng(0).integers(0, 512, size=(1, 19)).astype(np.int32)
    ref = hf_logits(path, ids)  # transformers upcasts the bf16 weights to f32
    f32 = load_pretrained(path, dtype="float32")
    assert f32.embed[...].dtype == jnp.float32
    assert np.abs(np.asarray(f32(jnp.asarray(ids))) - ref).max() / np.abs(ref).max() < 1e-4
    bf16 = load_pretrained(path, dtype="bfloat16")
    assert bf16.embed[...].dtype == jnp.bfloat16
    assert bf16.layers[0].mamba.A_log[...].dtype == jnp.float32  # decay rates stay f32
    out = np.asarray(bf16(jnp.asarray(ids)))
    assert np.abs(out - ref).max() / np.abs(ref).max() < 5e-2


def test_sharded_checkpoint_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = hf_checkpoint(tmp_path, "nemotron_h")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ids = np.arange(1, 30, dtype=np.int32)[None]
    np.testing.assert_array_equal(
        np.asarray(load_pretrained(sharded)(jnp.asarray(ids))), np.asarray(load_pretrained(path)(jnp.asarray(ids)))
    )
