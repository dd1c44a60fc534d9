"""Checkpoint loading errors, orbax round trip, and the determinism of random_model."""

from __future__ import annotations

import gc
import hashlib
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxmamba
from jaxmamba import CheckpointError, ConfigError, load_hf, load_pretrained, random_model, restore_orbax, save_orbax
from jaxmamba.config import FAMILIES


@pytest.fixture
def ckpt(tmp_path):
    return random_model("nemotron_h", path=tmp_path / "ckpt")


def _rewrite(path, mutate):
    tensors = load_file(str(path / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("backbone.layers.0.mixer.dt_bias"))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.dt_bias.*missing"):
        load_hf(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    def shrink(t):
        t["backbone.layers.1.mixer.k_proj.weight"] = t["backbone.layers.1.mixer.k_proj.weight"][:-1]
    _rewrite(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*shape \(31, 64\), expected \(32, 64\)"):
        load_hf(ckpt)


def test_extra_tensor_is_named(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("backbone.layers.9.mixer.bogus", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'backbone\.layers\.9\.mixer\.bogus'"):
        load_hf(ckpt)


def test_truncated_file_is_named(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_hf(ckpt)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf(ckpt)


def test_unknown_family_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_hf(ckpt)


def test_errors_are_value_errors(ckpt):
    _rewrite(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError):
        load_pretrained(ckpt)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_model_is_deterministic(tmp_path, family):
    a = random_model(family, seed=3, path=tmp_path / "a")
    b = random_model(family, seed=3, path=tmp_path / "b")
    c = random_model(family, seed=4, path=tmp_path / "c")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b) != digest(c)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_random_model_loads_in_transformers_identically(tmp_path):
    """The embedded default is a real HF checkpoint: transformers reads the same logits."""
    pytest.importorskip("transformers")
    from hf_reference import hf_logits

    ids = np.arange(3, 40, dtype=np.int32).reshape(1, -1)
    for family in FAMILIES:
        path = random_model(family, path=tmp_path / family)
        ref = hf_logits(path, ids)
        ours = np.asarray(load_pretrained(path)(ids))
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4, family


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_is_bit_exact(tmp_path, dtype):
    cfg, params = load_hf(random_model("falcon_h1", path=tmp_path / "hf"), dtype=dtype)
    save_orbax(tmp_path / "orbax", cfg, params)
    cfg2, params2 = restore_orbax(tmp_path / "orbax")
    assert cfg2 == cfg
    a, b = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    # load_pretrained reads the orbax directory directly too.
    ids = np.arange(1, 12, dtype=np.int32)[None]
    np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path / "orbax", dtype=dtype)(ids)),
                                  np.asarray(load_pretrained(tmp_path / "hf", dtype=dtype)(ids)))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_orbax_config_mismatch_is_an_error(tmp_path):
    cfg, params = load_hf(random_model("mamba2", path=tmp_path / "hf"))
    save_orbax(tmp_path / "orbax", cfg, params)
    raw = json.loads((tmp_path / "orbax" / "config.json").read_text())
    raw["state_size"] = 32
    (tmp_path / "orbax" / "config.json").write_text(json.dumps(raw))
    # Named before any read starts (a restore failing part-way left orbax's other reads pending: their errors
    # surfaced later from the garbage collector, in whatever test or cell ran then).
    with pytest.raises(CheckpointError, match=r"does not match its config.json: .*layers/0/mamba/in_proj: stored "
                       r"\(328, 64\), the config gives \(392, 64\).*\(and \d+ more\)"):
        restore_orbax(tmp_path / "orbax")
    raw["state_size"], raw["num_hidden_layers"] = json.loads((tmp_path / "hf" / "config.json").read_text())[
        "state_size"], 1
    (tmp_path / "orbax" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="layers/1/.*not a parameter of this config's model"):
        restore_orbax(tmp_path / "orbax")
    gc.collect()  # no read left pending: nothing for the collector to report (an error under this test's mark)


def test_public_api_is_exported():
    for name in ("HybridConfig", "load_pretrained", "random_model", "load_hf", "save_orbax", "restore_orbax"):
        assert hasattr(jaxmamba, name)


def test_loading_a_checkpoint_compiles_nothing(tmp_path):
    """Reading tensors and changing a small one's dtype happen on the host: a start's weight loading compiled a
    program per tensor shape (safetensors' flax reader, jnp.asarray(x, dtype=...)), at every start."""
    from flax import nnx

    from jaxmamba.compile_cache import CompileCounter

    path = random_model("nemotron_h", path=tmp_path / "bf16", dtype="bfloat16")  # float32 A_log, D, dt_bias
    CompileCounter.install()
    before = CompileCounter.count
    model = load_pretrained(path, dtype=None)  # the checkpoint's dtype
    assert model.dtype == np.dtype("bfloat16")
    a_logs = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
              if "A_log" in jax.tree_util.keystr(path)]
    assert a_logs and all(leaf.dtype == np.float32 for leaf in a_logs)
    assert CompileCounter.count == before


def test_random_model_of_config_writes_a_checkpoint_of_that_config(tmp_path):
    """``bench startup --config``'s checkpoint: the given config's shape (not the family's default), loadable."""
    from jaxmamba.config import HybridConfig
    from jaxmamba.random_checkpoint import random_config_dict, random_model_of_config
    from jaxmamba.weights import hf_tensor_specs

    cfg_dict = random_config_dict("nemotron_h", "tiny")
    cfg_dict.update(hidden_size=2 * cfg_dict["hidden_size"], vocab_size=cfg_dict["vocab_size"] + 64)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg_dict))
    path = random_model_of_config(config, tmp_path / "ckpt")
    expected = HybridConfig.from_hf(cfg_dict)
    tensors = load_file(str(path / "model.safetensors"))
    assert {s.hf_name: s.hf_shape for s in hf_tensor_specs(expected)} == {k: v.shape for k, v in tensors.items()}
    model = load_pretrained(path)
    assert model.cfg.hidden_size == expected.hidden_size and model.cfg.vocab_size == expected.vocab_size
