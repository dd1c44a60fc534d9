"""Data parallelism: replicas of the engine behind one front (``engine.data_parallel``) and the OpenAI server.

The router, the device split and the argument checks run here in the test process (no model). The served
check runs ``dp_worker.py`` in a process with 2 virtual CPU devices (an XLA flag that must be set before JAX
starts): the OpenAI server over ``data_parallel_size=2`` with prefix caching, against one engine offline.
Greedy tokens may differ from the reference only right after a near-tie (a step whose top-2 logprob gap in
the reference is below ``hf_reference.NEAR_TIE``: ``assert_greedy_match``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxmamba
from jaxmamba.engine.data_parallel import (DataParallelAsyncLLM, Router, check_one_process, leading_block_hashes,
                                           replica_devices)
from jaxmamba.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dp_worker.py")
_spec = importlib.util.spec_from_file_location("_jaxmamba_dp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)  # constants only: the worker imports jax inside its functions


# ---------------------------------------------------------------------- the router (no model)
def test_the_router_sends_each_request_to_the_least_loaded_replica_until_it_ends():
    router = Router(2, prefix_affinity=False, affinity_slack=4)
    assert router.route([], 100) == 0
    assert router.route([], 10) == 1
    assert router.route([], 10) == 1  # replica 1 holds 10 tokens, replica 0 100
    assert router.route([], 200) == 1  # 20 < 100
    router.release(0, 100)
    assert router.route([], 1) == 0
    assert [(load.requests, load.tokens) for load in router.loads] == [(1, 1), (3, 220)]


def test_the_router_keeps_a_prefix_on_the_replica_that_served_it():
    router = Router(2, prefix_affinity=True, affinity_slack=4)
    family = leading_block_hashes(list(range(48)), 16)
    other = leading_block_hashes(list(range(100, 148)), 16)
    assert router.route(other, 500) == 0
    assert router.route(family, 50) == 1  # by load: replica 0 is busy
    router.release(0, 500)
    router.release(1, 50)
    # Both idle: load alone picks replica 0; the family's blocks were served by replica 1.
    sibling = leading_block_hashes(list(range(32)) + [7] * 16, 16)  # the first two blocks shared
    assert router.route(sibling, 50) == 1
    assert [load.affinity_routed for load in router.loads] == [0, 1]
    # Without a shared leading block: by load (replica 1 now holds the sibling).
    assert router.route(leading_block_hashes([9] * 48, 16), 50) == 0


def test_affinity_yields_to_load_a_batch_past_the_least_loaded_replica():
    router = Router(2, prefix_affinity=True, affinity_slack=2)
    family = leading_block_hashes(list(range(32)), 16)
    assert router.route(family, 10) == 0
    assert router.route(family, 10) == 0  # affine; replica 0 then runs 2 requests, replica 1 none
    assert router.route(family, 10) == 1  # 2 - 0 is not below the slack: the least loaded replica instead
    assert router.route(family, 10) == 1  # and the family now follows replica 1


def test_the_router_forgets_the_oldest_blocks_past_its_capacity():
    router = Router(2, prefix_affinity=True, affinity_slack=4, capacity=2)
    first = leading_block_hashes(list(range(32)), 16)
    assert router.route([], 1000) == 0
    assert router.route(first, 10) == 1
    assert router.route(leading_block_hashes([5] * 32, 16), 1) == 1  # its two hashes push out first's two
    router.release(0, 1000)
    assert router.route(first, 1) == 0  # by load: replica 1 is remembered for first no more
    assert [load.affinity_routed for load in router.loads] == [0, 0]


def test_block_hashes_cover_full_blocks_and_chain_on_the_prefix():
    a = leading_block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the 8 tokens past the second block are no full block
    b = leading_block_hashes(list(range(16)) + [0] * 16, 16)
    assert a[0] == b[0] and a[1] != b[1]
    c = leading_block_hashes([0] * 16 + list(range(16, 32)), 16)
    assert c[1] != a[1]  # the same second block after another first one


# ---------------------------------------------------------------------- arguments
def test_replicas_get_disjoint_device_sets():
    devices = [f"d{i}" for i in range(8)]
    assert replica_devices(2, 3, devices) == [["d0", "d1", "d2"], ["d3", "d4", "d5"]]
    assert replica_devices(1, 1, devices) == [["d0"]]


@pytest.mark.parametrize("dp, tp, message", [
    (3, 3, r"data_parallel_size=3 \* tensor_parallel_size=3 = 9 devices, but only 8"),
    (0, 1, "data_parallel_size=0 must be a positive int"),
    (2, 1.5, "tensor_parallel_size=1.5 must be a positive int"),
])
def test_bad_replica_counts_name_the_problem(dp, tp, message):
    with pytest.raises(ConfigError, match=message):
        replica_devices(dp, tp, [f"d{i}" for i in range(8)])


def test_more_replicas_than_devices_fail_before_any_model_loads():
    # The test process has one CPU device; the model path is never read.
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 \* tensor_parallel_size=1 = 2 devices, but only 1"):
        DataParallelAsyncLLM("/nonexistent/checkpoint", data_parallel_size=2)


def test_data_parallelism_over_several_processes_is_refused():
    with pytest.raises(ConfigError, match="data_parallel_size=2 with num_processes=2"):
        check_one_process(2, 2)
    check_one_process(1, 2)
    check_one_process(2, None)


def test_an_engine_runs_on_exactly_its_ranks_devices():
    import jax

    from jaxmamba.engine.core import EngineCore
    from jaxmamba.engine.engine_args import EngineConfig

    with pytest.raises(ConfigError, match="2 devices given for tensor_parallel_size=1"):
        EngineCore("/nonexistent/checkpoint", EngineConfig(), devices=jax.devices() * 2)


# ---------------------------------------------------------------------- served, 2 replicas
@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dp")
    ckpt = jaxmamba.random_model("nemotron_h", "tiny", seed=1, path=tmp / "ckpt", n_groups=1,
                                 layers_block_type=["linear_attention", "full_attention", "mlp"])
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = tmp / "out.json"
    run = subprocess.run([sys.executable, str(WORKER), str(ckpt), str(out)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    if run.returncode != 0 or not out.exists():
        pytest.fail(f"dp_worker.py failed (rc={run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.slow
def test_two_replicas_behind_the_server(served):
    from hf_reference import assert_greedy_match

    ref, spread = served["reference"], served["spread"]
    # Requests at once spread over both replicas, each with the tokens one engine gives.
    assert sorted(set(spread["replicas"])) == [0, 1], spread["replicas"]
    for i, (ours, theirs) in enumerate(zip(spread["tokens"], ref["tokens"], strict=True)):
        assert_greedy_match(ours, theirs, np.asarray(ref["top2"][i]), f"prompt {i}")
    # The same prompts over HTTP: the texts one engine gives (where the tokens matched: a near-tie aside).
    for i, text in enumerate(served["http"]):
        if spread["tokens"][i] == ref["tokens"][i]:
            assert text == ref["texts"][i], i
    # A client that hung up: its request stopped short and its replica's pools are empty again.
    abort = served["abort"]
    assert abort["replica"] == 0 and abort["blocks_while_running"] > 0
    assert abort["pools_after"] == [{"blocks_in_use": 0, "slots_in_use": 0}] * 2
    before_long = 2 * len(worker.prompts()) * worker.MAX_TOKENS + 2  # spread, http, the family's first
    assert sum(abort["generated"]) - before_long < worker.LONG_TOKENS
    assert served["pools_at_end"] == [{"blocks_in_use": 0, "slots_in_use": 0}] * 2


@pytest.mark.slow
def test_a_shared_prefix_follows_its_replica_behind_the_server(served):
    a = served["affinity"]
    mid = [m - b for m, b in zip(a["routed_mid"], a["routed_before"], strict=True)]
    after = [x - m for x, m in zip(a["routed_after"], a["routed_mid"], strict=True)]
    assert mid == [1, 1]  # the long request on replica 0, so the family's first went to replica 1 by load
    assert after == [0, 1] and a["affinity_routed"] == [0, 1]  # both idle: load alone would pick replica 0
    assert a["hit_tokens"][1] >= 16 and a["hit_tokens"][0] == 0  # the sibling resumed from replica 1's cache


@pytest.mark.slow
def test_metrics_are_per_replica(served):
    text = served["metrics"]
    for engine in ("0", "1"):
        generated = re.search(rf'vllm:generation_tokens_total{{engine="{engine}",model_name="tiny"}} (\S+)', text)
        assert generated and float(generated.group(1)) > 0, engine
        assert f'vllm:num_requests_running{{engine="{engine}",model_name="tiny"}} 0.0' in text
    assert ('jaxmamba:data_parallel_routed_requests_total{by="prefix_affinity",engine="1",model_name="tiny"} 1.0'
            in text)
