"""Capacity planning: pools sized from a memory budget, ``plan`` equal to what ``LLM`` allocates,
and step temporaries that do not depend on the pool sizes (what lets the planner size pools
from one compile)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import pytest

import jaxmamba
from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.random_checkpoint import random_config_dict
from jaxmamba.plan import GIB, cache_unit_bytes, compile_buckets, plan, probe_pools, size_pools
from jaxmamba.steps import Bucket
from stand_in_gpu import StandInH100

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jaxmamba.random_model("nemotron_h", size="tiny", seed=0, path=tmp_path_factory.mktemp("nh") / "ckpt")


@pytest.fixture(scope="module")
def cfg(tiny):
    return HybridConfig.from_hf(tiny)


def test_cache_units_follow_the_layouts(cfg):
    block, slot = cache_unit_bytes(cfg, block_size=16, dtype=jnp.float32)
    # (2, block, kv_heads, head_dim) per attention layer; conv (conv_dim, K-1) + ssm (H, P, N) per Mamba layer.
    assert block == len(cfg.attention_layer_ids) * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    conv_dim = cfg.mamba_intermediate_size + 2 * cfg.mamba_n_groups * cfg.mamba_d_state
    ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_d_state
    assert slot == len(cfg.mamba_layer_ids) * (conv_dim * (cfg.mamba_conv_kernel - 1) + ssm) * 4
    # bf16 halves both; a float32 SSM cache keeps its part at 4 bytes.
    block16, slot16 = cache_unit_bytes(cfg, block_size=16, dtype=jnp.bfloat16, ssm_dtype=jnp.float32)
    assert block16 == block // 2
    assert slot16 == len(cfg.mamba_layer_ids) * (conv_dim * (cfg.mamba_conv_kernel - 1) * 2 + ssm * 4)


def test_budget_fills_blocks_after_slots(cfg):
    block, slot = cache_unit_bytes(cfg, block_size=16)
    budget = 40 * slot + 300 * block
    pools = size_pools(budget, cfg, max_num_seqs=8, max_model_len=256, block_size=16, cap_blocks=False)
    assert pools.num_slots == 1 + 8
    assert pools.num_blocks == (budget - pools.num_slots * slot) // block
    assert pools.cache_bytes <= budget
    # 16 blocks per request at 256 tokens; 8 slots cap the running requests.
    assert pools.max_concurrency == min(8, round((pools.num_blocks - 1) / 16, 2))
    capped = size_pools(budget, cfg, max_num_seqs=8, max_model_len=256, block_size=16, cap_blocks=True)
    assert capped.num_blocks == 8 * 16 + 1  # never more than max_num_seqs requests at max_model_len can use


def test_prefix_caching_gives_every_block_a_state_slot(cfg):
    block, slot = cache_unit_bytes(cfg, block_size=16)
    budget = 10 * slot + 100 * (block + slot)
    pools = size_pools(budget, cfg, max_num_seqs=2, max_model_len=64, block_size=16, cache_mode="align",
                       cap_blocks=False)
    assert pools.num_slots == 1 + 2 + pools.num_blocks
    assert pools.cache_bytes <= budget
    assert pools.num_blocks == (budget - 3 * slot) // (block + slot)


def test_slots_shrink_to_what_fits_beside_one_full_request(cfg):
    block, slot = cache_unit_bytes(cfg, block_size=16)
    one = 16 * block + slot  # 256 tokens
    budget = (slot + block) + one + 3 * slot  # null + one request + 3 more slots
    pools = size_pools(budget, cfg, max_num_seqs=64, max_model_len=256, block_size=16, cap_blocks=False)
    assert pools.num_slots == 1 + 4
    assert pools.num_blocks - 1 >= 16


def test_a_config_that_cannot_hold_one_request_is_refused_with_numbers(cfg):
    block, slot = cache_unit_bytes(cfg, block_size=16)
    with pytest.raises(ConfigError, match=r"max_model_len=4096.*256 KV blocks.*lower max_model_len"):
        size_pools(100 * block, cfg, max_num_seqs=1, max_model_len=4096, block_size=16)


def test_explicit_counts_win(cfg):
    pools = size_pools(1, cfg, max_num_seqs=4, max_model_len=256, block_size=16, num_blocks=7, num_slots=9)
    assert (pools.num_blocks, pools.num_slots) == (7, 9)
    with pytest.raises(ConfigError, match="num_blocks=1 must be >= 2"):
        size_pools(GIB, cfg, max_num_seqs=4, max_model_len=256, block_size=16, num_blocks=1)


def test_attention_free_models_need_no_block_memory():
    cfg = HybridConfig.from_hf(random_config_dict("mamba2", "tiny"))
    block, slot = cache_unit_bytes(cfg, block_size=16)
    assert block == 0
    pools = size_pools(5 * slot, cfg, max_num_seqs=8, max_model_len=1024, block_size=16)
    assert pools.num_slots == 5  # 4 running requests + null: what 5 slots of memory hold
    assert pools.max_concurrency == 4.0


def test_plan_equals_what_llm_allocates(tiny):
    budget_gib = 0.0003  # ~315 KiB: fewer blocks than 4 requests at max_model_len would use
    one_bucket = dict(ENGINE, buckets=[(4, 32)])  # compile time: one bucket is enough to compare
    planned = plan(tiny, "cpu", cpu_memory_gib=budget_gib, **one_bucket)
    llm = jaxmamba.LLM(tiny, cpu_memory_gib=budget_gib, **one_bucket)
    assert (llm.pools.num_blocks, llm.pools.num_slots) == (planned.num_blocks, planned.num_slots)
    assert llm.pools.num_blocks < 4 * 16 + 1  # the budget, not the worst case, sized it
    assert [c.shape[0] for c in llm.runner.caches.conv] == [planned.num_slots] * len(llm.cfg.mamba_layer_ids)
    assert [k.shape[1] for k in llm.runner.caches.kv] == [planned.num_blocks] * len(llm.cfg.attention_layer_ids)
    assert planned.weight_bytes == sum(math.prod(p.shape) * p.dtype.itemsize
                                       for p in jax_leaves(llm.model))
    assert len(planned.buckets) == llm.stats.num_buckets
    assert all(b.temp_bytes > 0 for b in planned.buckets)
    # Generation still works in the budgeted pools.
    out = llm.generate([[1, 2, 3]], jaxmamba.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.check_invariants()


def jax_leaves(model):
    import jax
    from flax import nnx

    return jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))


def test_llm_refuses_a_budget_below_one_request(tiny):
    with pytest.raises(ConfigError, match="one request of max_model_len=256"):
        jaxmamba.LLM(tiny, cpu_memory_gib=1e-6, **ENGINE)


def test_step_temporaries_do_not_depend_on_pool_sizes(tiny):
    """What lets ``plan`` and ``LLM`` size pools from one compile at small pools."""
    model = jaxmamba.load_pretrained(tiny)
    sizing = dict(max_num_seqs=4, max_model_len=256, block_size=16)
    small = probe_pools(model.cfg, **sizing)
    large = size_pools(64 * GIB, model.cfg, **sizing, cap_blocks=False, num_blocks=small.num_blocks * 8,
                       num_slots=small.num_slots * 8)
    bucket = Bucket(32, 4, False)
    temps = [compile_buckets(model, pools, (bucket,), block_size=16, max_model_len=256, cache_mode="none",
                             num_spec=0, enable_caching=False, ssm_dtype=jnp.float32,
                             backend="reference").memory[bucket].temp_bytes for pools in (small, large)]
    assert temps[0] == temps[1]


def test_auto_dtype_and_backend(tmp_path):
    path = jaxmamba.random_model("mamba2", size="tiny", seed=1, path=tmp_path / "bf16", dtype="bfloat16")
    llm = jaxmamba.LLM(path, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, buckets=[(2, 16)])
    assert llm.model.dtype == jnp.bfloat16  # the checkpoint's torch_dtype
    assert llm.runner.caches.ssm[0].dtype == jnp.bfloat16  # mamba_ssm_cache_dtype follows, as vLLM's "auto"
    assert llm.runner.steps.wait_ready(300)  # a warm start's program (and its memory) arrives in the background
    assert llm.runner.steps.memory  # compiled
    from jaxmamba.plan import resolve_kernel_backend

    assert resolve_kernel_backend("auto", on_gpu=False) == "reference"
    assert resolve_kernel_backend("auto", on_gpu=True) == "pallas"
    with pytest.raises(ConfigError, match="kernel_backend='triton'"):
        resolve_kernel_backend("triton")


def test_plan_cli_writes_the_json_other_tools_read(tmp_path, tiny, capsys):
    from jaxmamba.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", str(tiny / "config.json"), "--target", "cpu", "--max-num-seqs", "2",
               "--max-num-batched-tokens", "16", "--max-model-len", "64", "--json", str(out), "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {"target", "weight_bytes", "num_blocks", "num_slots", "max_concurrency", "buckets", "kernels"} <= set(data)
    assert data["target"] == "cpu" and data["num_blocks"] == 2 * 4 + 1
    assert {"num_tokens", "num_reqs", "decode_only", "temp_bytes", "argument_bytes", "output_bytes",
            "alias_bytes"} <= set(data["buckets"][0])
    assert "maximum concurrency for 64 tokens" in capsys.readouterr().out
    rc = main(["plan", str(tiny / "config.json"), "--target", "cpu", "--max-model-len", "4096",
               "--cpu-memory-gib", "0.00001", "--quiet"])
    assert rc == 2
    assert "one request of max_model_len=4096" in capsys.readouterr().err


def test_a_full_decode_batch_takes_the_decode_bucket():
    """Bucket(128, 128, decode) and Bucket(128, 128, mixed) tie on size; the mixed one sorts first, and
    every full-batch decode used to run the prefill kernels through it."""
    from jaxmamba.steps import default_buckets, select_bucket

    buckets = default_buckets(256, 2048)
    assert Bucket(256, 256, False) in buckets and Bucket(256, 256, True) in buckets
    for n in (1, 3, 64, 100, 128, 200):
        chosen = select_bucket(buckets, n, n, decode_only=True)
        assert chosen.decode_only and chosen.num_reqs >= n
    assert select_bucket(buckets, 256, 256, decode_only=True) == Bucket(256, 256, True)
    assert not select_bucket(buckets, 3, 40, decode_only=False).decode_only
    # A decode batch that no decode bucket holds (spec-decode rows beyond them) still finds a mixed one.
    only_mixed = (Bucket(64, 8, False),)
    assert select_bucket(only_mixed, 8, 8, decode_only=True) == Bucket(64, 8, False)


def test_small_mixed_steps_have_buckets_with_fewer_rows():
    from jaxmamba.steps import default_buckets, select_bucket

    buckets = default_buckets(256, 1024)
    mixed = sorted((b.num_tokens, b.num_reqs) for b in buckets if not b.decode_only)
    assert (16, 16) in mixed and (64, 64) in mixed and (512, 256) in mixed
    assert all(r == min(t, 256) for t, r in mixed)  # a batch of T tokens has at most T rows
    assert select_bucket(buckets, 3, 14, decode_only=False) == Bucket(16, 16, False)
    assert select_bucket(buckets, 40, 60, decode_only=False) == Bucket(64, 64, False)
    assert select_bucket(buckets, 40, 60, decode_only=False, num_prefills=3) == Bucket(64, 64, False, 4)
    assert select_bucket(buckets, 200, 60 + 190, decode_only=False) == Bucket(256, 256, False)
    # Engines with max_num_seqs <= 16 (the tests' and notebooks') keep exactly their buckets.
    assert default_buckets(8, 64) == tuple(sorted(
        [Bucket(r, r, True) for r in (1, 2, 4, 8)] + [Bucket(t, 8, False) for t in (16, 32, 64)]))


def test_mixed_buckets_have_prefill_row_rungs():
    """A step of many decodes and a few prompt chunks takes a bucket sized for its prefill rows."""
    from jaxmamba.steps import default_buckets, engine_buckets, prefill_rows_ladder, select_bucket

    assert prefill_rows_ladder(8) == [8] and prefill_rows_ladder(16) == [16] and prefill_rows_ladder(32) == [4, 32]
    assert prefill_rows_ladder(256) == [4, 256]
    buckets = default_buckets(256, 1024)
    assert {b.num_prefills for b in buckets if b.num_reqs == 256 and not b.decode_only and b.num_tokens < 1024} == {
        4, 256}
    assert all(b.num_prefills == 0 for b in buckets if b.decode_only)
    assert select_bucket(buckets, 250, 254, decode_only=False, num_prefills=2) == Bucket(256, 256, False, 4)
    assert select_bucket(buckets, 250, 254, decode_only=False, num_prefills=20) == Bucket(256, 256, False, 256)
    assert select_bucket(buckets, 250, 254, decode_only=False) == Bucket(256, 256, False, 256)
    # The token budget's rung, where a loaded engine's admissions land, has a middle rung: a step of 5-8 prompt
    # chunks carries 8 rows of SSD chunks and states, not 256 (one chunk per 512 tokens at larger budgets).
    assert prefill_rows_ladder(256, 1024, top=True) == [4, 8, 256] and prefill_rows_ladder(256, 8192, True) == [
        4, 16, 256]
    assert prefill_rows_ladder(16, 64, top=True) == [16]  # no room between 4 and R: nothing added
    assert {b.num_prefills for b in buckets if b.num_tokens == 1024} == {4, 8, 256}
    assert select_bucket(buckets, 250, 1000, decode_only=False, num_prefills=7) == Bucket(1024, 256, False, 8)
    assert select_bucket(buckets, 250, 1000, decode_only=False, num_prefills=9) == Bucket(1024, 256, False, 256)
    assert {b.num_prefills for b in default_buckets(256, 8192) if b.num_tokens == 8192} == {4, 16, 256}
    assert Bucket(64, 8, False) == Bucket(64, 8, False, 8)
    with pytest.raises(ConfigError, match="num_prefills=9"):
        Bucket(64, 8, False, 9)
    # Explicit buckets: pairs hold every row as a prefill; triples name P; one must hold the worst batch.
    assert engine_buckets(8, 64, buckets=[(8, 64), (8, 32, 2)]) == (Bucket(32, 8, False, 2), Bucket(64, 8, False))
    with pytest.raises(ConfigError, match="all prefills"):
        engine_buckets(8, 64, buckets=[(8, 64, 4)])
    with pytest.raises(ConfigError, match="must be"):
        engine_buckets(8, 64, buckets=[(8, 64, 4, 1)])


def test_prefill_rows_size_the_mixed_step(tiny):
    """XLA's memory analysis of a compiled mixed step: SSD chunk arrays and gathered states follow the
    bucket's prefill rows (every mixed step once carried R rows of them)."""
    model = jaxmamba.load_pretrained(tiny)
    sizing = dict(max_num_seqs=64, max_model_len=256, block_size=16)
    pools = probe_pools(model.cfg, **sizing)
    temps = {}
    for p in (4, 64):
        bucket = Bucket(128, 64, False, p)
        temps[p] = compile_buckets(model, pools, (bucket,), block_size=16, max_model_len=256, cache_mode="none",
                                   num_spec=0, enable_caching=False, ssm_dtype=jnp.float32,
                                   backend="reference").memory[bucket].temp_bytes
    assert temps[4] < 0.8 * temps[64], temps


def test_decode_bucket_temporaries_do_not_depend_on_the_token_budget(tiny):
    """A decode step's cost follows its rows, whatever max_num_batched_tokens the engine allows
    (mixed buckets grow with the budget, decode buckets must not)."""
    temps = []
    for budget in (64, 512):
        llm = jaxmamba.LLM(tiny, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512)
        assert llm.runner.steps.wait_ready(300)  # a warm start's programs (and their memory) arrive in the background
        memory = llm.runner.steps.memory
        temps.append({b: m.temp_bytes for b, m in memory.items() if b.decode_only})
        assert max(m.temp_bytes for m in memory.values()) > max(temps[-1].values())  # mixed buckets are dearer
    assert temps[0].keys() == temps[1].keys() and len(temps[0]) == 4
    assert temps[0] == temps[1]


def test_plan_cli_takes_explicit_buckets_with_prefill_rows(tmp_path, tiny, capsys):
    from jaxmamba.cli import main

    out = tmp_path / "plan.json"
    rc = main(["plan", str(tiny / "config.json"), "--target", "cpu", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "32", "--max-model-len", "64", "--buckets", "4,32", "4,16,1",
               "--json", str(out), "--quiet"])
    assert rc == 0
    rows = {(b["num_reqs"], b["num_tokens"], b["num_prefills"]) for b in json.loads(out.read_text())["buckets"]}
    assert rows == {(4, 32, 4), (4, 16, 1)}
    assert "(16, 4, P=1)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(tiny / "config.json"), "--target", "cpu", "--buckets", "4,x"])
    assert exc.value.code == 2
    assert "must be R,T or R,T,P" in capsys.readouterr().err


def test_gpu_cache_budget_is_utilisation_minus_weights_minus_the_largest_step(tiny, monkeypatch):
    """LLM's GPU start-up profile (only a GPU runs it), on a stand-in H100: utilisation x the target's memory
    (capped by what the runtime allows) - weights - the largest bucket's temporaries."""
    import jax
    from flax import nnx

    from jaxmamba.plan import gpu_cache_budget, largest_bucket_temp_bytes, param_bytes
    from jaxmamba.steps import default_buckets

    model = jaxmamba.load_pretrained(tiny)
    buckets = default_buckets(4, 32)
    sizing = dict(max_num_seqs=4, max_model_len=256, block_size=16, num_spec=0, cache_mode="none",
                  dtype=jnp.float32, ssm_dtype=jnp.float32)
    largest, temp = largest_bucket_temp_bytes(model, buckets, sizing, backend="reference")
    assert largest == Bucket(32, 4, False) and temp > 0
    weights = param_bytes(nnx.state(model, nnx.Param))
    h100 = 84978434048  # device_memory_size of jaxmamba/targets/h100.txtpb
    # The persistent device tables, whole on every rank (replicated): the block table, int32[max rows + null
    # row, cdiv(max_model_len, block_size)], and the Mamba state-index table, int32[same rows, 1 + num_spec]
    # in mode none.
    table = (4 + 1) * (256 // 16) * 4 + (4 + 1) * (1 + sizing.get("num_spec", 0)) * 4
    monkeypatch.setattr(jax, "devices", lambda *a: [StandInH100(80 * GIB)])
    assert gpu_cache_budget(model, buckets, 0.5, "reference", sizing) == int(0.5 * h100) - weights - temp - table
    monkeypatch.setattr(jax, "devices", lambda *a: [StandInH100(10 * GIB)])  # the runtime allows less
    assert (gpu_cache_budget(model, buckets, 0.9, "reference", sizing, tp_size=2)
            == 10 * GIB - weights // 2 - temp - table)


def test_the_sizing_probe_reads_its_temporaries_when_a_warm_start_restores_it(tiny, tmp_path):
    """A GPU engine sizes its pools from the largest bucket's temporaries (``gpu_cache_budget``), compiled with
    the engine's executable cache. On a warm start that probe is restored from the cache, and a restore the
    engine hands to the background thread had not put the program's memory in place when the probe read it:
    the second start raised a KeyError. The same function twice over one cache: the second call restores."""
    from jaxmamba.compile_cache import ExecutableCache
    from jaxmamba.plan import largest_bucket_temp_bytes
    from jaxmamba.steps import default_buckets

    model = jaxmamba.load_pretrained(tiny)
    sizing = dict(max_num_seqs=4, max_model_len=256, block_size=16, num_spec=0, cache_mode="none",
                  dtype=jnp.float32, ssm_dtype=jnp.float32)
    cache = ExecutableCache(tmp_path / "steps")
    builds = []
    cold = largest_bucket_temp_bytes(model, default_buckets(4, 32), sizing, backend="reference",
                                     executable_cache=cache, builds=builds)
    warm = largest_bucket_temp_bytes(model, default_buckets(4, 32), sizing, backend="reference",
                                     executable_cache=cache, builds=builds)
    assert [b.num_restored for b in builds] == [0, 1] and builds[1].num_compiled == 0  # the warm call restored
    assert warm == cold and cold[1] > 0


@pytest.mark.parametrize("mode", ["none", "align"])
def test_device_table_bytes_are_the_persistent_tables_size(tiny, mode):
    """The planner counts exactly the tables the runner allocates (rows for the largest bucket plus the null
    row): the block table (~4 MiB at a 128k context and 128 rows) and the Mamba state-index table (1 + num_spec
    columns in mode none, as wide as the block table in align/all); the plan reports them."""
    from jaxmamba.engine.block_table import block_table_bytes, device_tables_bytes

    assert block_table_bytes(128, 131072, 16) == 129 * 8192 * 4
    assert device_tables_bytes(128, 131072, 16, "none") == 129 * (8192 + 1) * 4
    assert device_tables_bytes(128, 131072, 16, "all", num_spec=2) == 129 * (8192 + 8192 + 2) * 4
    args = dict(ENGINE, buckets=[(4, 32)], enable_prefix_caching=mode != "none")
    llm = jaxmamba.LLM(tiny, cpu_memory_gib=0.01, **args)
    tables = llm.runner.block_table.array.nbytes + llm.runner.state_table.array.nbytes
    assert tables == device_tables_bytes(4, ENGINE["max_model_len"], llm.block_size, mode)
    planned = plan(tiny, "cpu", cpu_memory_gib=0.01, **args)
    assert planned.device_tables_bytes == planned.to_json()["device_tables_bytes"] == tables
    assert f"device tables {tables / (1 << 20):.2f} MiB" in planned.format()


def test_plan_reports_decode_traffic_beside_the_ideal_bytes(tiny, capsys):
    """Decode buckets carry the step's bytes moved (read from its optimized HLO), the ideal bytes at the
    plan's mean context and the kernels launched; mixed buckets carry none."""
    from jaxmamba.plan import write_json
    from jaxmamba.roofline import ideal_decode_bytes

    cfg = HybridConfig.from_hf(tiny)
    result = plan(tiny / "config.json", "cpu", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                  mean_context=24)
    decode = [b for b in result.buckets if b.decode_only]
    assert decode and result.mean_context == 24
    for b in decode:
        assert b.ideal_bytes == ideal_decode_bytes(cfg, b.num_reqs, 24, jnp.float32, weights=result.weight_bytes).total
        assert b.bytes_moved >= result.weight_bytes  # every weight is read at least once
        assert b.kernel_launches > 0
        assert sum(b.bytes_by_source.values()) == b.bytes_moved and "jaxmamba/sampling.py" in b.bytes_by_source
    assert all(b.bytes_moved is None for b in result.buckets if not b.decode_only)
    assert "decode step traffic at a mean context of 24 tokens" in result.format()
    assert plan(tiny / "config.json", "cpu", max_num_seqs=2, max_num_batched_tokens=16,
                max_model_len=64).mean_context == 32  # default: half of max_model_len
