"""Tensor parallelism (``jaxmamba.parallel``): vLLM's per-rank weights and cache pages, TP logits = TP=1.

The multi-device checks need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` *before* jax
initialises, while the rest of the suite runs on one device; so they run once per session in a
subprocess (``tp_worker.py``, started by the ``tp_results`` fixture), which measures, and the
tests below assert on its numbers. Configuration errors and the pure index maps are checked in
process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxmamba import parallel as par
from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.layout import conv_channel_split, kv_cache_shape, state_shapes
from jaxmamba.random_checkpoint import random_config_dict
from transfer import pages
from transfer.hetero_tp import TransferShape

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")

_spec = importlib.util.spec_from_file_location("_jaxmamba_tp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)  # case lists only: the worker imports jax inside main()

TOL = 1e-5  # f32 relative error, max|tp - ref| / max|ref|


def _run_worker(mode: str, timeout: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(WORKER), mode], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"tp_worker.py {mode} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_results() -> dict:
    return _run_worker("fast", timeout=900)


def _forward_ids(cases):
    return [worker.case_id(f, o, tp) for f, o, tps, _ in cases for tp in tps]


def _state_ids(cases):
    return [worker.case_id(f, o, tp) for f, o, _, tps in cases for tp in tps]


# ============================================================================ multi-device (subprocess)
def test_worker_ran_on_eight_devices(tp_results):
    assert tp_results["devices"] == 8


@pytest.mark.parametrize("case", _forward_ids(worker.FAST_CASES))
def test_tp_logits_match_tp1(tp_results, case):
    r = tp_results["forward"][case]
    assert r["shape_ok"]
    assert r["rel_err"] <= TOL, f"{case}: TP logits differ from TP=1 by {r['rel_err']:.3g} (relative)"


@pytest.mark.parametrize("case", _forward_ids(worker.FAST_CASES))
def test_device_shards_are_vllm_rank_weights(tp_results, case):
    r = tp_results["weights"][case]
    tp = int(case.rsplit("@tp", 1)[1])
    assert r["checked"] == r["num_params"] * tp  # every parameter on every rank
    assert r["mismatched"] == [], f"{case}: shards differ from vLLM's rank tensors: {r['mismatched'][:8]}"
    assert r["roundtrip"], f"{case}: unshard_params does not restore the HF tensors"


@pytest.mark.parametrize("case", _state_ids(worker.FAST_CASES))
def test_tp_prefill_state_is_transfer_pages_of_tp1_state(tp_results, case):
    """What each rank holds after a TP prefill == transfer.pages' rank page of the TP=1 state."""
    r = tp_results["states"][case]
    assert r["num_checks"] > 0 and r["shapes_ok"]
    assert r["rel_err"] <= TOL, f"{case}: rank pages differ from transfer.pages by {r['rel_err']:.3g}"
    assert r["logits_rel_err"] <= TOL and r["tp1_prefill_logits_rel_err"] <= TOL


@pytest.mark.parametrize("case", [worker.cache_case_id(c) for c in worker.CACHE_CASES])
def test_cache_pages_are_byte_identical_to_transfer_pages(tp_results, case):
    r = tp_results["caches"][case]
    assert r["mismatched"] == [], f"{case}: {r['mismatched'][:8]}"
    assert r["roundtrip"], f"{case}: gather_logical_caches does not invert place_logical_caches"
    assert r["zero_caches_ok"], f"{case}: shard_caches per-rank shapes/page sizes differ from jaxmamba.layout"


def test_wrong_in_proj_layout_is_detected(tp_results):
    """Sharding in_proj rows contiguously (not [z_r|x_r|B_r|C_r|dt_r]) must break the logits check."""
    assert tp_results["negative"]["contiguous_in_proj_rel_err"] > 100 * TOL


@pytest.mark.slow
def test_full_family_group_tp_matrix():
    """Every family x n_groups {1,2,4} x valid TP in {1,2,4,8}: logits, weights and rank pages."""
    res = _run_worker("full", timeout=3000)
    assert res["devices"] == 8
    cases = worker._full_cases()
    assert set(_forward_ids(cases)) <= set(res["forward"])
    assert set(_state_ids(cases)) <= set(res["states"])
    bad = {k: v["rel_err"] for k, v in res["forward"].items() if not v["rel_err"] <= TOL}
    bad.update({f"states:{k}": v["rel_err"] for k, v in res["states"].items()
                if not (v["rel_err"] <= TOL and v["shapes_ok"] and v["logits_rel_err"] <= TOL)})
    bad.update({f"weights:{k}": v["mismatched"][:4] for k, v in res["weights"].items()
                if v["mismatched"] or not v["roundtrip"]})
    assert not bad, bad


# ============================================================================ in process (one device)
def _cfg(family: str, **overrides) -> HybridConfig:
    return HybridConfig.from_hf(random_config_dict(family, "tiny", **overrides))


@pytest.mark.parametrize(
    "family, overrides, tp, field",
    [
        ("nemotron_h", {"n_groups": 2}, 4, "mamba_n_groups=2"),
        ("bamba", {"mamba_n_groups": 4}, 8, "mamba_n_groups=4"),
        ("mamba2", {"n_groups": 1}, 16, "mamba_num_heads=8"),
        ("nemotron_h", {"n_groups": 1}, 8, "num_attention_heads=4"),
        ("nemotron_h", {"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads=3"),
        ("bamba", {"mamba_n_groups": 1, "num_attention_heads": 24, "num_key_value_heads": 3}, 8,
         "num_key_value_heads=3"),
        ("nemotron_h", {"n_groups": 1, "num_attention_heads": 8, "intermediate_size": 100}, 8, "intermediate_size=100"),
        ("granite_hybrid", {"mamba_n_groups": 1, "num_attention_heads": 8, "shared_intermediate_size": 100}, 8,
         "intermediate_size=100"),
        # FusedMoE splits every expert's intermediate dimension, and the shared experts'.
        ("nemotron_h_moe", {"n_groups": 1, "moe_intermediate_size": 34}, 4, "moe_intermediate_size=34"),
        ("nemotron_h_moe", {"n_groups": 1, "moe_shared_expert_intermediate_size": 50}, 4,
         "moe_shared_expert_intermediate_size=50"),
        ("granite_hybrid_moe", {"mamba_n_groups": 1, "intermediate_size": 30}, 4, "moe_intermediate_size=30"),
    ],
)
def test_bad_tp_ratio_names_the_field(family, overrides, tp, field):
    cfg = _cfg(family, **overrides)
    with pytest.raises(ConfigError, match=field):
        par.validate_tp(cfg, tp)
    # make_mesh checks the model before counting devices, and shard_params / local_config refuse too.
    with pytest.raises(ConfigError, match=field):
        par.make_mesh(tp, cfg=cfg)
    with pytest.raises(ConfigError, match=field):
        par.local_config(cfg, tp)


@pytest.mark.parametrize("tp", [0, -2, True, 2.0])
def test_bad_tp_size(tp):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        par.make_mesh(tp)


def test_too_few_devices():
    import jax

    n = len(jax.devices())
    with pytest.raises(ConfigError, match=f"tensor_parallel_size={n + 1} needs {n + 1} devices"):
        par.make_mesh(n + 1)
    mesh = par.make_mesh(1)
    assert mesh.axis_names == (par.TP_AXIS,) and par.mesh_tp_size(mesh) == 1


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        par.validate_tp(_cfg("nemotron_h"), 4)


@pytest.mark.parametrize("g, tp", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (4, 2), (4, 4)])
def test_conv_and_in_proj_index_against_transfer_pages(g, tp):
    cfg = _cfg("mamba2", n_groups=g)
    shape = TransferShape.from_config(cfg, conv_dtype=2, ssm_dtype=4)
    per_rank = [pages.rank_conv_channels(shape, tp, r) for r in range(tp)]
    conv = par.conv_channel_index(cfg, tp)
    np.testing.assert_array_equal(conv, np.concatenate(per_rank))
    split = conv_channel_split(cfg, tp)
    assert conv.shape[0] == tp * split.conv_dim_local == tp * state_shapes(cfg, tp)[0][0]
    # in_proj = [z (I) | xBC (conv_dim) | dt (H)]; rank r: z of its x channels, its xBC, its heads.
    i, h = cfg.mamba_intermediate_size, cfg.mamba_num_heads
    want = np.concatenate([
        np.concatenate([c[: i // tp], i + c, i + cfg.mamba_conv_dim + np.arange(r * h // tp, (r + 1) * h // tp)])
        for r, c in enumerate(per_rank)
    ])
    np.testing.assert_array_equal(par.in_proj_index(cfg, tp), want)
    # Local config sizes are vLLM's per-rank sizes.
    lc = par.local_config(cfg, tp)
    assert lc.mamba_conv_dim == split.conv_dim_local
    assert lc.mamba_num_heads == state_shapes(cfg, tp)[1][0]
    assert lc.mamba_in_proj_size * tp == par.in_proj_index(cfg, tp).shape[0]


@pytest.mark.parametrize("kv, tp", [(2, 1), (2, 2), (2, 4), (2, 8), (4, 2), (1, 4)])
def test_kv_head_index_against_transfer_pages(kv, tp):
    cfg = _cfg("nemotron_h", num_attention_heads=8, num_key_value_heads=kv, n_groups=1)
    heads = par.kv_head_index(cfg, tp)
    np.testing.assert_array_equal(heads, np.concatenate([pages.rank_kv_heads(kv, tp, r) for r in range(tp)]))
    assert heads.shape[0] == tp * kv_cache_shape(1, 1, kv, cfg.head_dim, tp)[3]
    assert par.local_config(cfg, tp).num_key_value_heads == kv_cache_shape(1, 1, kv, cfg.head_dim, tp)[3]


def test_vocab_is_padded_with_zero_rows():
    cfg = _cfg("granite_hybrid", vocab_size=509, mamba_n_groups=4)
    axis, index = par.tp_index(cfg, 4, ("embed",))
    assert axis == 0 and index.shape == (512,)
    np.testing.assert_array_equal(index[:509], np.arange(509))
    assert (index[509:] == -1).all()
    assert par.local_config(cfg, 4).vocab_size == 128


def test_parameter_without_a_rule_is_an_error():
    cfg = _cfg("nemotron_h")
    with pytest.raises(ValueError, match="layers.0.mamba.new_weight"):
        par.tp_index(cfg, 2, ("layers", 0, "mamba", "new_weight"))


# ============================================================================ the engine under TP
@pytest.fixture(scope="module")
def tp_engine_results() -> dict:
    return _run_worker("engine", timeout=900)


@pytest.fixture(scope="module")
def tp_slow_engine_results() -> dict:
    return _run_worker("engine-slow", timeout=900)


@pytest.mark.parametrize("case", [worker.case_id(f, o, tp) for f, o, tps in worker.ENGINE_CASES for tp in tps])
def test_llm_tensor_parallel_matches_tp1(tp_engine_results, case):
    """LLM(tensor_parallel_size=N): same greedy tokens and logprobs as TP=1, compiled once per bucket."""
    _assert_matches_tp1(tp_engine_results["engine"][case])


@pytest.mark.slow
@pytest.mark.parametrize("case", [worker.case_id(f, o, tp) for f, o, tps in worker.SLOW_ENGINE_CASES for tp in tps])
def test_llm_tensor_parallel_matches_tp1_moe_and_mamba2(tp_slow_engine_results, case):
    """As ``test_llm_tensor_parallel_matches_tp1``, for the MoE hybrids and pure Mamba2 at TP=8."""
    _assert_matches_tp1(tp_slow_engine_results["engine"][case])


def _assert_matches_tp1(r: dict) -> None:
    assert r["tokens_equal"], r
    assert r["max_logprob_diff"] < 1e-4, r
    assert r["compilations"] == r["programs"] and r["compiles_while_serving"] == 0, r
    assert r["slots_in_use"] == 0


def test_multi_step_windows_under_tensor_parallelism(tp_engine_results):
    """TP=2 with num_scheduler_steps=4: the tokens of the TP=1 one-step engine, in fewer steps than tokens."""
    r = tp_engine_results["multi_step_tp2"]
    assert r["tokens_equal"] and r["max_logprob_diff"] < 1e-4, r
    assert r["steps"] < r["max_tokens"] and r["compiles_while_serving"] == 0, r


def test_prefix_caching_under_tensor_parallelism(tp_engine_results):
    """TP=2, mode all: hits restore every rank's KV and (conv, SSM) pages; tokens equal the TP=1 engine's."""
    r = tp_engine_results["prefix_caching_tp2"]
    assert r["tokens_equal"], r
    assert r["hit_tokens"] >= 4 * 32, r  # four later requests each resume after the 32-token prefix
    assert r["compiles_while_serving"] == 0 and r["slots_in_use"] == 0 and r["blocks_in_use"] == 0, r


def test_llm_tensor_parallel_caches_are_vllm_rank_pages(tp_engine_results):
    # falcon_h1 tiny (I=128, G=1 replicated, N=16) at TP=4: conv_dim_local = 128/4 + 2*16, K-1 = 3 rows.
    key = worker.case_id("falcon_h1", {"mamba_n_groups": 1}, 4)
    assert tp_engine_results["engine"][key]["conv_shard_shape"][1:] == [32 + 32, 3]
