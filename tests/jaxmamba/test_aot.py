"""Deviceless H100 compilation: every bucket of the serving step, Pallas kernels included, goes through
XLA's GPU pipeline down to ptxas for sm_90a on this CPU; no spill and no shared-memory overflow.

The compiles run in ``python -m jaxmamba plan`` subprocesses: ptxas' register report needs a wrapper on
the CUDA path jax reads when it loads its CUDA plugin, before this process imported jax."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jaxmamba
from jaxmamba import aot
from jaxmamba.errors import ConfigError

CONFIGS = Path(jaxmamba.__file__).parent / "configs"
MAMBA_KERNELS = ("causal_conv1d_update", "causal_conv1d_varlen", "selective_state_update", "ssd_")


def test_targets_are_hardware_facts():
    h100, h200 = aot.get_target("h100"), aot.get_target("h200")
    assert h100.compute_capability == (9, 0) and h100.sm_arch == "sm_90a"
    assert h100.sm_count == 132 and h100.shared_memory_per_block_optin == 227 * 1024
    assert 79 << 30 < h100.memory_bytes < 80 << 30
    assert h200.sm_count == h100.sm_count and h200.memory_bytes > 140 << 30
    assert h200.memory_bandwidth > h100.memory_bandwidth
    with pytest.raises(ConfigError, match="unknown target 'a100'.*h100, h200"):
        aot.get_target("a100")


def test_ptxas_and_thunk_reports_parse():
    log = ("ptxas info    : Compiling entry function 'k1' for 'sm_90a'\nptxas info    : Function properties for k1\n"
           "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert aot.parse_ptxas_log(log) == {"k1": (255, 12)}
    thunks = "001: kCustomKernel [source | sink] k1 grid: [4, 2, 1] threads: [128, 1, 1]  shared_memory: 1024 bytes\n"
    assert aot.parse_thunk_sequence(thunks) == [("k1", (4, 2, 1), (128, 1, 1), 1024)]
    bad = aot.KernelStats("k1", 255, 12, 300 * 1024, (1,), (128,), True)
    problems = aot.check_kernels_fit([bad], "h100")
    assert any("spills" in p for p in problems) and any("shared memory" in p for p in problems)


def _plan(model, tmp_path, *args) -> dict:
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_ROOT", "JAXMAMBA_PTXAS_LOG")}
    proc = subprocess.run([sys.executable, "-m", "jaxmamba", "plan", str(model), "--target", "h100",
                           "--kernel-backend", "pallas", "--json", str(out), "--quiet", *args],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_fits(plan: dict) -> None:
    names = [k["name"] for k in plan["kernels"]]
    for kernel in MAMBA_KERNELS:
        assert any(n.startswith(kernel) for n in names), (kernel, names)
    limit = aot.get_target("h100").shared_memory_per_block_optin
    for k in plan["kernels"]:
        assert k["registers"] is not None, f"no ptxas report for {k['name']}"
        assert k["spill_bytes"] == 0, k
        assert k["shared_bytes"] <= limit, k
    for b in plan["buckets"]:
        assert b["argument_bytes"] > 0 and b["alias_bytes"] > 0  # caches donated and updated in place


@pytest.mark.aot
def test_every_bucket_of_the_tiny_model_compiles_for_h100(tmp_path):
    ckpt = jaxmamba.random_model("nemotron_h", size="tiny", seed=0, path=tmp_path / "ckpt")
    plan = _plan(ckpt, tmp_path, "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "256",
                 "--enable-prefix-caching")
    assert [(b["num_tokens"], b["num_reqs"], b["decode_only"]) for b in plan["buckets"]] == [
        (1, 1, True), (2, 2, True), (16, 2, False)]
    _check_fits(plan)
    # A GPU target's plan process keeps glibc's arenas (cli.cmd_plan): its compiles run side by side, one per core.
    assert (plan["one_malloc_arena"], plan["build_threads"]) == (False, len(os.sched_getaffinity(0)))
    # Attention runs as the Triton kernels too, not the Pallas interpreter compiled for the GPU.
    names = [k["name"] for k in plan["kernels"]]
    assert any(n.startswith("paged_attention_decode") for n in names), names
    assert any(n.startswith("paged_attention_varlen") for n in names), names
    assert plan["target"] == "h100" and plan["num_blocks"] > 2 * 16 + 1  # a GPU with prefix caching: no cap
    # The budget leaves room for the persistent device tables (3 rows: the block table's 16 columns and, with
    # prefix caching (mode align), a state-index table as wide, of int32).
    assert plan["device_tables_bytes"] == (2 + 1) * (16 + 16) * 4
    # The mixed bucket's compiled FLOPs (every Pallas kernel's work known) at least what its batch needs.
    mixed = [b for b in plan["buckets"] if not b["decode_only"]]
    assert mixed and all(b["unknown_kernels"] is None and b["flops"] >= b["batch_flops"] > 0 for b in mixed), mixed
    assert all(b["flops"] is None for b in plan["buckets"] if b["decode_only"])
    assert plan["budget_bytes"] <= (int(0.9 * plan["device_memory_bytes"]) - plan["weight_bytes"]
                                    - max(b["temp_bytes"] for b in plan["buckets"]) - plan["device_tables_bytes"])


@pytest.mark.aot
def test_decode_windows_compile_for_h100(tmp_path):
    """``num_scheduler_steps``: each pure-decode bucket's window (the Triton decode kernels inside a loop of
    steps) compiles for the H100 too and fits; the budget leaves room for the hungriest program."""
    ckpt = jaxmamba.random_model("nemotron_h", size="tiny", seed=0, path=tmp_path / "ckpt")
    plan = _plan(ckpt, tmp_path, "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "256",
                 "--num-scheduler-steps", "4")
    _check_fits(plan)
    names = [k["name"] for k in plan["kernels"]]
    assert any(n.startswith("selective_state_update") for n in names), names
    # A GPU target compiles the full sampling tail only: one program a bucket, two for a decode bucket.
    assert [b["num_programs"] for b in plan["buckets"]] == [2 if b["decode_only"] else 1 for b in plan["buckets"]]
    assert plan["budget_bytes"] <= (int(0.9 * plan["device_memory_bytes"]) - plan["weight_bytes"]
                                    - max(b["temp_bytes"] for b in plan["buckets"]) - plan["device_tables_bytes"])


@pytest.mark.aot
def test_an_8b_nemotron_h_config_alone_plans_for_h100(tmp_path):
    """52 layers at Nemotron-H-8B's shapes, from its config.json only: nothing is allocated."""
    # One row keeps the compile count (and CI time) down: a decode and a mixed bucket.
    plan = _plan(CONFIGS / "nemotron_h_8b.json", tmp_path, "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                 "--max-model-len", "8192")
    _check_fits(plan)
    assert [(b["num_tokens"], b["num_reqs"], b["decode_only"]) for b in plan["buckets"]] == [
        (1, 1, True), (16, 1, False)]
    assert 15 << 30 < plan["weight_bytes"] < 17 << 30  # ~8.1B parameters in bf16
    assert plan["num_slots"] == 1 + 1 and plan["num_blocks"] == 512 + 1
    assert plan["max_concurrency"] == 1.0


@pytest.mark.aot
def test_importing_jaxmamba_first_keeps_the_cuda_plugin_usable_without_a_gpu():
    """Without JAX_PLATFORMS, jax drops its CUDA plugin on a machine with no driver (and prints a traceback);
    importing jaxmamba first keeps jax on the CPU so compile-only targets work from Python."""
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("a machine with an NVIDIA driver keeps jax's own platform choice")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import jaxmamba; from jaxmamba import aot; import jax; print(aot.target_device('h100').device_kind, jax.default_backend())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "cpu" and "H100" in proc.stdout
    assert "Unable to load CUDA" not in proc.stderr


def _nemotron_h_8b_widths(layers: str = "M*M-"):
    """The 8B's widths (hidden 4096, 128 Mamba heads x 64, 8 groups, state 128, 32/8 attention heads x 128,
    relu2 MLP 21504) in ``layers`` (``M`` Mamba, ``*`` attention, ``-`` MLP), vocab 32768, bf16."""
    from jaxmamba.config import HybridConfig

    raw = json.loads((CONFIGS / "nemotron_h_8b.json").read_text())
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    raw.update(vocab_size=32768, layers_block_type=[kinds[c] for c in layers])
    return HybridConfig.from_hf(raw)


@pytest.fixture(scope="module")
def decode_traffic_8b_widths():
    """Every decode bucket of ``max_num_seqs`` 128 at the 8B's widths (layers ``M*M-``), compiled for the H100:
    ``{bucket: plan.decode_traffic fields}`` at a 96-token mean context (a GPU decode run's shape:
    64-token prompts, 64 new tokens; BENCHMARKS.md)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxmamba.model import HybridForCausalLM
    from jaxmamba.plan import abstract_caches, compile_buckets, decode_traffic, param_bytes, size_pools
    from jaxmamba.steps import engine_buckets

    if not aot.aot_available():
        pytest.skip(f"needs the aot extra: {aot.AOT_INSTALL_HINT}")
    cfg, dt = _nemotron_h_8b_widths(), jnp.bfloat16
    model = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dt))
    pools = size_pools(40 << 30, cfg, max_num_seqs=128, max_model_len=2048, block_size=16, dtype=dt, ssm_dtype=dt)
    caches = abstract_caches(cfg, pools, block_size=16, num_spec=0, dtype=dt, ssm_dtype=dt)
    decode = [b for b in engine_buckets(128, 8192) if b.decode_only]
    steps = compile_buckets(model, pools, decode, block_size=16, max_model_len=2048, cache_mode="none", num_spec=0,
                            enable_caching=False, ssm_dtype=dt, backend="pallas", target="h100",
                            sampling_variants="all")
    weights = param_bytes(nnx.state(model, nnx.Param))
    return {b: decode_traffic(steps, b, caches, cfg, 96, dt, dt, weights) for b in decode}


@pytest.mark.aot
@pytest.mark.slow
def test_8b_widths_decode_steps_but_their_sampling_tail_move_at_most_1_2x_their_ideal_bytes(
        decode_traffic_8b_widths):
    """The model's share of every decode bucket (all but ``jaxmamba/sampling.py``'s operations): weights,
    state, KV and the activations between them within 1.2x of what the step must move."""
    from jaxmamba.steps import engine_buckets

    assert len(decode_traffic_8b_widths) == len([b for b in engine_buckets(128, 8192) if b.decode_only])
    for bucket, t in decode_traffic_8b_widths.items():
        model_side = t["bytes_moved"] - sum(t["bytes_by_source"].get(f"jaxmamba/{name}.py", 0)
                                            for name in ("sampling", "sampling_filter"))
        assert t["ideal_bytes"] <= model_side <= 1.2 * t["ideal_bytes"], (bucket, t)


@pytest.mark.aot
@pytest.mark.slow
def test_8b_widths_decode_buckets_move_at_most_1_3x_their_ideal_bytes(decode_traffic_8b_widths):
    """The whole step, its full sampling tail on the sampled path included (the sampler's rare exact fallbacks
    are reported apart, ``worst_case_extra_bytes``)."""
    for bucket, t in decode_traffic_8b_widths.items():
        assert t["bytes_moved"] <= 1.3 * t["ideal_bytes"], (bucket, t)


@pytest.mark.aot
@pytest.mark.slow
def test_8b_widths_full_sampling_tail_costs_at_most_1_2x_the_greedy_one(decode_traffic_8b_widths):
    for bucket, t in decode_traffic_8b_widths.items():
        assert t["greedy_bytes_moved"] < t["bytes_moved"] <= 1.2 * t["greedy_bytes_moved"], (bucket, t)


@pytest.mark.aot
@pytest.mark.slow
def test_8b_widths_mixed_buckets_compute_at_most_1_25x_the_flops_of_the_batch_that_fills_them():
    """Every mixed bucket of (256, 2048) at the 8B's widths (layers ``M*M-``), compiled for the H100: the
    contractions the step performs for the batch that fills it (projections over real tokens, the SSD's
    tiles of real chunks, attention's key tiles, the LM head on the sampled rows) within 1.25x of what that
    batch needs; the one-token-row buckets were 1.61x with 64-row SSD tiles."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxmamba.model import HybridForCausalLM
    from jaxmamba.plan import compile_buckets, mixed_flops, probe_pools
    from jaxmamba.steps import engine_buckets

    if not aot.aot_available():
        pytest.skip(f"needs the aot extra: {aot.AOT_INSTALL_HINT}")
    cfg, dt = _nemotron_h_8b_widths(), jnp.bfloat16
    model = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dt))
    pools = probe_pools(cfg, max_num_seqs=256, max_model_len=2048, block_size=16, dtype=dt, ssm_dtype=dt)
    mixed = [b for b in engine_buckets(256, 2048) if not b.decode_only]
    steps = compile_buckets(model, pools, mixed, block_size=16, max_model_len=2048, cache_mode="none", num_spec=0,
                            enable_caching=False, ssm_dtype=dt, backend="pallas", target="h100")
    for bucket in mixed:
        f = mixed_flops(steps, bucket, cfg, decode_context=1024)
        assert f["unknown_kernels"] is None and f["batch_flops"] <= f["flops"] <= 1.25 * f["batch_flops"], (bucket, f)
