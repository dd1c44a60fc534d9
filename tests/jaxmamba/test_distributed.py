"""The engine on JAX's multi-controller runtime (``jax.distributed``): two processes on 127.0.0.1, 2 virtual CPU
devices each, gloo collectives, ``LLM(tensor_parallel_size=4)`` over the 4 global devices.

The processes run ``dist_worker.py`` (the device count is an XLA flag that must be set before JAX starts); this
file asserts. The workload has chunked prefill and prefix caching (mode all); its outputs are compared with the
same engine at TP=4 in one process and at TP=1. Greedy tokens may differ only right after a near-tie: a step
whose top-2 logprob gap (the top-2 logit gap) in the reference is below ``hf_reference.NEAR_TIE``
(``assert_greedy_match``). The argument checks need no second process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxmamba
from jaxmamba.errors import ConfigError
from jaxmamba.parallel import distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("_jaxmamba_dist_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)  # constants only: the worker imports jax inside its modes

LOGPROB_TOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _models(tmp: Path, names: list[str]) -> list[str]:
    """Tiny random checkpoints, 3 layers each (Mamba, attention, then an MLP or the experts): n_groups=1 so
    that TP=4 shards them."""
    made = {
        "dense": lambda p: jaxmamba.random_model("nemotron_h", "tiny", seed=1, path=p, n_groups=1,
                                                 layers_block_type=["linear_attention", "full_attention", "mlp"]),
        "moe": lambda p: jaxmamba.random_model("nemotron_h_moe", "tiny", seed=1, path=p, n_groups=1,
                                               layers_block_type=["linear_attention", "moe", "full_attention"]),
    }
    return [f"{name}={made[name](tmp / name)}" for name in names]


def _run(tmp: Path, names: list[str], kill: bool, timeout: float = 900) -> dict:
    """The pair and the one-process reference, side by side; returns every result and the pair's exits."""
    specs = _models(tmp, names)
    port = _free_port()
    outs = [str(tmp / f"pair{i}.json") for i in range(2)]
    pair = [subprocess.Popen([sys.executable, str(WORKER), "pair", str(i), str(port), outs[i], *specs,
                              *(["--kill"] if kill else [])], cwd=REPO, env=_env(2), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    single_out = str(tmp / "single.json")
    single = subprocess.run([sys.executable, str(WORKER), "single", single_out, *specs], cwd=REPO, env=_env(4),
                            capture_output=True, text=True, timeout=timeout)
    if single.returncode != 0:
        for p in pair:
            p.kill()
        pytest.fail(f"dist_worker.py single failed (rc={single.returncode}):\n{single.stderr[-4000:]}")
    exits = []
    for i, p in enumerate(pair):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in pair:
                q.kill()
            pytest.fail(f"process {i} of the pair did not exit within {timeout} s (a hang)")
        exits.append({"rc": p.returncode, "stderr": err, "exited_at": time.time()})
    for i in range(2):
        if not Path(outs[i]).exists():
            pytest.fail(f"process {i} of the pair wrote no results (rc={exits[i]['rc']}):\n{exits[i]['stderr'][-4000:]}")
    killed = Path(outs[1] + ".killed")
    return {"pair": [json.loads(Path(o).read_text()) for o in outs], "single": json.loads(Path(single_out).read_text()),
            "exits": exits, "killed_at": float(killed.read_text()) if killed.exists() else None}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    """Dense hybrid; afterwards process 1 is killed mid-batch."""
    return _run(tmp_path_factory.mktemp("dist-dense"), ["dense"], kill=True)


def _check_against(got: dict, ref: dict, what: str) -> None:
    """Greedy tokens equal but for a divergence right after a near-tie of the reference; logprobs within
    LOGPROB_TOL up to the first divergence."""
    from hf_reference import assert_greedy_match

    assert len(got["tokens"]) == len(ref["tokens"])
    for i, (ours, theirs) in enumerate(zip(got["tokens"], ref["tokens"])):
        top2 = np.asarray(ref["top2"][i])  # (steps, 2): the top-2 logprobs, whose gap is the top-2 logit gap
        assert_greedy_match(ours, theirs, top2, f"{what}, prompt {i}")
        same = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        diff = np.abs(np.asarray(got["logprobs"][i][:same]) - np.asarray(ref["logprobs"][i][:same]))
        assert diff.size == 0 or diff.max() < LOGPROB_TOL, f"{what}, prompt {i}: logprob differs by {diff.max():.2e}"


def _check_served(r: dict) -> None:
    assert r["hit_tokens"] >= 2 * 32, r  # the second wave's two prompts resume after the 32 cached tokens
    assert r["compiles_while_serving"] == 0, r  # no per-step cross-process equality check compiling programs
    assert r["slots_in_use"] == 0 and r["blocks_in_use"] == 0, r


def test_two_processes_build_one_four_device_mesh(dense):
    for pid, r in enumerate(dense["pair"]):
        assert r["runtime"] == {"process_count": 2, "process_index": pid, "device_count": 4,
                                "local_device_count": 2}
        assert r["dense"]["mesh_processes"] == [0, 1]


def test_every_process_gets_the_same_outputs(dense):
    """The SPMD idiom: both processes call generate with the same prompts and read the same replicated outputs."""
    a, b = (r["dense"] for r in dense["pair"])
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    _check_served(a)


@pytest.mark.parametrize("reference", ["tp4", "tp1"])
def test_two_process_tp4_matches_one_process(dense, reference):
    """TP=4 across two processes: the tokens and logprobs of TP=4 in one process and of TP=1 (chunked prefill,
    prefix-cache hits)."""
    ref = dense["single"]["dense"][reference]
    _check_served(ref)
    _check_against(dense["pair"][0]["dense"], ref, f"2 processes vs one process at {reference}")


def test_serving_across_processes_process_0_leads(dense):
    """Process 0 takes the same waves through AsyncLLM (concurrent requests, and one abandoned after two outputs,
    hence aborted) and leads; process 1 replays its steps (engine.multiprocess.follow): the same tokens as the
    offline run, every step run by both, and both processes' pools empty after the abort."""
    leader, follower = (r["serving"] for r in dense["pair"])
    offline = dense["pair"][0]["dense"]
    assert leader["tokens"] == offline["tokens"]
    assert np.allclose(np.concatenate(leader["logprobs"]), np.concatenate(offline["logprobs"]), atol=LOGPROB_TOL)
    assert follower["steps"] == follower["steps_followed"] == leader["steps"] > 0, (leader, follower)
    for side in (leader, follower):
        assert side["slots_in_use"] == 0 and side["blocks_in_use"] == 0, side


def test_a_killed_process_ends_the_other_with_a_named_error(dense):
    """Process 1 is SIGKILLed after a step of a batch: process 0's next step fails and it exits with
    DistributedError (or the runtime's heartbeat error) within the heartbeat timeout, never a silent hang."""
    assert dense["killed_at"] is not None, "process 1 never reached the kill"
    survivor = dense["exits"][0]
    assert survivor["rc"] != 0, survivor["stderr"][-3000:]
    assert ("DistributedError" in survivor["stderr"]
            or "stopped sending heartbeats" in survivor["stderr"]), survivor["stderr"][-3000:]
    assert "finished a batch whose peer died" not in survivor["stderr"]
    if "DistributedError" in survivor["stderr"]:
        # Its own error ended it, not an abort at the runtime's shutdown barrier (status -6) that buries it.
        assert survivor["rc"] == distributed.PEER_LOST_EXIT_CODE, (survivor["rc"], survivor["stderr"][-3000:])
        assert "without jax.distributed's shutdown barrier" in survivor["stderr"], survivor["stderr"][-3000:]
    waited = survivor["exited_at"] - dense["killed_at"]
    assert waited < worker.HEARTBEAT_TIMEOUT_S + 30, f"process 0 took {waited:.0f} s to exit after the kill"


@pytest.mark.slow
def test_two_process_tp4_moe_matches_one_process(tmp_path):
    """The MoE hybrid (routing replicated, experts' intermediate dimension split) likewise."""
    r = _run(tmp_path, ["moe"], kill=False)
    a, b = (p["moe"] for p in r["pair"])
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    _check_served(a)
    for reference in ("tp4", "tp1"):
        _check_against(a, r["single"]["moe"][reference], f"MoE: 2 processes vs one process at {reference}")
    assert all(e["rc"] == 0 for e in r["exits"]), [e["stderr"][-2000:] for e in r["exits"]]


# ============================================================================ the arguments (no second process)
@pytest.mark.parametrize("args, message", [
    (("127.0.0.1:1234", 2, None), "process_id must be given"),
    ((None, 2, 0), "coordinator_address must be given"),
    (("127.0.0.1", 2, 0), "must be 'host:port'"),
    (("http://10.0.0.1:1234", 2, 0), "must be 'host:port'"),
    (("10.0.0.1:70000", 2, 0), "port 70000 is outside"),
    (("10.0.0.1:1234", 0, 0), "num_processes=0 must be >= 1"),
    (("10.0.0.1:1234", 2, 2), "process_id=2 is out of range for num_processes=2"),
    (("10.0.0.1:1234", 2, -1), "process_id=-1 must be >= 0"),
    (("10.0.0.1:1234", "2", 0), "num_processes='2' must be an int"),
])
def test_bad_distributed_arguments_name_the_problem(args, message):
    with pytest.raises(ConfigError, match=message):
        distributed.check_distributed_args(*args)
    with pytest.raises(ConfigError, match=message):  # before the engine loads anything
        jaxmamba.LLM("/nonexistent", coordinator_address=args[0], num_processes=args[1], process_id=args[2])


def test_good_addresses_pass():
    for address in ("127.0.0.1:1234", "node-3.cluster.local:8476", "[fe80::1]:1234"):
        distributed.check_distributed_args(address, 4, 3)
    distributed.check_distributed_args(None, None, None)


def test_tp_devices_checks_the_share_of_every_process(monkeypatch):
    """tp_devices on a fake 2-process device list: the split per process, and the errors naming the counts."""

    class FakeDevice:
        def __init__(self, id_, process_index):
            self.id, self.process_index = id_, process_index

    devices = [FakeDevice(i, i // 2) for i in range(4)]
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    assert [d.id for d in distributed.tp_devices(4, devices)] == [0, 1, 2, 3]
    assert [d.id for d in distributed.tp_devices(2, devices)] == [0, 2]
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 is not a multiple of the process count 2"):
        distributed.tp_devices(3, devices)
    with pytest.raises(ConfigError, match="needs 4 devices in each; process 0 has 2"):
        distributed.tp_devices(8, devices)


_EXIT_AFTER_PEER_LOSS = """
import atexit, sys
from jaxmamba.parallel import distributed
atexit.register(lambda: print("the runtime's shutdown barrier ran", flush=True))  # where JAX's hook stands
distributed.runtime_is_initialized = lambda: True  # a runtime without a second process
try:
    raise distributed.DistributedError("process 1 stopped answering")
except distributed.DistributedError:
    pass
print("exiting normally", flush=True)
"""


def test_a_distributed_error_exits_without_the_shutdown_barrier():
    """After a DistributedError the process exits with PEER_LOST_EXIT_CODE and the error on stderr, and the
    exit hooks registered before (JAX's, with its shutdown barrier) never run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run([sys.executable, "-c", _EXIT_AFTER_PEER_LOSS], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == distributed.PEER_LOST_EXIT_CODE, (run.returncode, run.stderr[-2000:])
    assert "exiting normally" in run.stdout and "shutdown barrier ran" not in run.stdout
    assert "jaxmamba: DistributedError: process 1 stopped answering" in run.stderr
    # Without the runtime (this test process) it registers nothing: a one-process run exits as it would.
    distributed.exit_without_shutdown_barrier("no runtime here")
    assert distributed._lost == []


_HUNG_STEP = """
import time
from jaxmamba.parallel import distributed
watchdog = distributed.StepWatchdog(1.0)
with watchdog.watch("step 1"):
    pass
time.sleep(1.5)
print("a step that ended in time passed", flush=True)
with watchdog.watch("step 2"):
    time.sleep(60)  # a collective whose peer hangs
print("the hung step returned", flush=True)
"""


def test_a_step_that_never_completes_ends_the_process_with_a_named_error():
    """A peer that hangs with its heartbeat alive: the step waiting on it times out (StepWatchdog) and the
    process exits with PEER_LOST_EXIT_CODE and DistributedError naming the step and the timeout."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.time()
    run = subprocess.run([sys.executable, "-c", _HUNG_STEP], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert time.time() - start < 50, "the watchdog did not end the hung step"
    assert run.returncode == distributed.PEER_LOST_EXIT_CODE, (run.returncode, run.stderr[-2000:])
    assert "a step that ended in time passed" in run.stdout and "the hung step returned" not in run.stdout
    assert "DistributedError: process 0: step 2 did not complete within 1 s (distributed_timeout_s)" in run.stderr
    with pytest.raises(ConfigError, match="timeout_s=0 must be > 0"):
        distributed.StepWatchdog(0)


def test_joining_after_jax_started_is_refused():
    """A process that already ran JAX cannot join a runtime: ConfigError saying why, at once (no connection)."""
    import jax

    jax.devices()
    if distributed.runtime_is_initialized():
        pytest.skip("this test process already joined a runtime")
    start = time.time()
    with pytest.raises(ConfigError, match="already ran a JAX computation"):
        distributed.initialize("127.0.0.1:1", 2, 1, initialization_timeout_s=5)
    assert time.time() - start < 5


class _FakeChannel:
    def __init__(self, messages):
        self.messages = messages

    def receive(self, n):
        import pickle

        return pickle.dumps(self.messages[n])


class _FakeCore:
    def __init__(self):
        self.last_step, self.queued, self.steps = [], [], 0

    def queue(self, req):
        self.queued.append(req)

    def step(self):
        self.steps += 1


def _follow(monkeypatch, messages):
    from jaxmamba.engine import multiprocess

    monkeypatch.setattr(multiprocess, "_channel", lambda: _FakeChannel(messages))
    monkeypatch.setattr(multiprocess.jax, "process_index", lambda: 1)
    core = _FakeCore()
    return core, multiprocess.follow(core)


def test_a_follower_replays_commands_and_stops(monkeypatch):
    from jaxmamba import SamplingParams
    from jaxmamba.engine.multiprocess import _step_digest

    params = SamplingParams(max_tokens=3)
    empty = _step_digest(_FakeCore())
    core, n = _follow(monkeypatch, [
        {"commands": [("add", "a", [1, 2], params, 7, 0, ())], "digest": "", "stop": False, "error": None},
        {"commands": [], "digest": empty, "stop": False, "error": None},
        {"commands": [], "digest": empty, "stop": True, "error": None},
    ])
    assert n == 2 and core.steps == 2
    (req,) = core.queued
    assert (req.request_id, req.prompt_token_ids, req.seed, req.arrival) == ("a", [1, 2], 7, 0)


def test_a_follower_stops_on_a_divergent_step_or_a_leader_that_exited(monkeypatch):
    from jaxmamba.parallel.distributed import DistributedError

    with pytest.raises(DistributedError, match="step 0 differs from the leader's"):
        _follow(monkeypatch, [{"commands": [], "digest": "", "stop": False, "error": None},
                              {"commands": [], "digest": "something else", "stop": False, "error": None}])
    with pytest.raises(DistributedError, match="process 0 exited without stopping its followers"):
        _follow(monkeypatch, [{"commands": [], "digest": "", "stop": True,
                               "error": "process 0 exited without stopping its followers (see its log)"}])


@pytest.mark.slow
def test_the_server_spans_two_processes(tmp_path):
    """``python -m jaxmamba serve`` on two processes: process 0 answers HTTP with TP=4 over both processes'
    devices, process 1 follows; Ctrl-C on process 0 stops both (process 1's follow() returns)."""
    import signal
    import urllib.request

    pytest.importorskip("uvicorn")
    (spec,) = _models(tmp_path, ["dense"])
    path = spec.split("=", 1)[1]
    coordinator, http = _free_port(), _free_port()
    env = _env(2)
    env["JAXMAMBA_COMPILE_CACHE"] = str(tmp_path / "xla")
    procs = [subprocess.Popen([sys.executable, "-m", "jaxmamba", "serve", path, "--tensor-parallel-size", "4",
                               "--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                               "--process-id", str(i), "--port", str(http), "--max-model-len", "64",
                               "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--quiet"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        deadline = time.time() + 600
        while True:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(2)
        body = json.dumps({"model": Path(path).name, "prompt": [5, 17, 42, 7], "max_tokens": 4,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["usage"]["completion_tokens"] == 4, answer
        procs[0].send_signal(signal.SIGINT)
        errs = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
        assert "process 1: following process 0's steps" in errs[1], errs[1][-3000:]
        steps = int(errs[1].split("process 0 stopped after ")[1].split()[0])
        assert steps >= 4, errs[1][-3000:]  # the completion's prefill and decodes ran on process 1 too
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_multi_process_engine_refuses_what_depends_on_timing(monkeypatch):
    """compile='lazy' (a batch's bucket would follow a background compile's progress) and the executable cache
    are refused on the multi-process runtime; the cache is off by default there."""
    from jaxmamba.engine.engine_args import EngineConfig

    monkeypatch.setattr(distributed, "initialize", lambda *args, **kwargs: True)  # as on a 2-process runtime
    with pytest.raises(ConfigError, match="needs compile='eager'"):
        EngineConfig(compile="lazy")
    with pytest.raises(ConfigError, match="executable_cache=True: a multi-process engine"):
        EngineConfig(executable_cache=True)
    assert EngineConfig().executable_cache is False


def test_async_llm_stops_taking_requests_after_a_distributed_error():
    """A leader whose step raised DistributedError (a peer died) fails its streams with it and refuses new
    requests (EngineShutdownError: the server's 503) instead of stepping again out of step with the others."""
    import asyncio
    import types

    from jaxmamba.engine.async_engine import AsyncLLM, EngineShutdownError
    from jaxmamba.engine.llm_engine import LLMEngine
    from jaxmamba.parallel.distributed import DistributedError

    class DeadPeerEngine(LLMEngine):
        def __init__(self):  # no model: only what AsyncLLM's engine thread calls
            self.engine_core = types.SimpleNamespace(mesh=None)
            self.pending, self.aborted = False, []

        def has_unfinished_requests(self):
            return self.pending

        def add_request(self, request_id, prompt, params=None):
            self.pending = True

        def abort_request(self, request_ids):
            self.aborted.append(request_ids)
            self.pending = False

        def step(self):
            raise DistributedError("process 0 of 2: an engine step failed (a peer died)")

    fake = DeadPeerEngine()
    engine = AsyncLLM(fake)

    async def drive():
        with pytest.raises(DistributedError, match="a peer died"):
            async for _ in engine.generate([1, 2], None, "first"):
                pass
        with pytest.raises(EngineShutdownError, match="the multi-process engine stopped"):
            async for _ in engine.generate([1, 2], None, "second"):
                pass

    try:
        asyncio.run(drive())
    finally:
        engine.shutdown()
    assert fake.aborted == ["first"]
