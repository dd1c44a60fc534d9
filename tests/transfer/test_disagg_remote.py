"""P/D across hosts (``jaxmamba.engine.disagg.remote``, ``transfer.control``): a prefill engine started as
``python -m jaxmamba serve-prefill MODEL --kv-listen 127.0.0.1:0`` and a decode engine given the address it
prints (``generate --kv-peer``, or ``RemoteDisaggregation`` in this process), nothing shared between them
but that address: the control channel is TCP, the pages go over NIXL/UCX.

Model and engine sizes as tests/transfer/test_disagg.py (random NemotronH tiny, ``n_groups`` 1, one
bucket, block size 8); prompts of 17, 9, 30, 2, 1 and 45 tokens. The oracle is one engine in this process:
with both sides at TP=1 the tokens must be identical. Faults: a prefill engine that is unreachable, silent,
or killed between requests (the prompts are computed on D, the error names its address), a handoff whose
lease ran out (computed on D), and the P side freeing a lost decode engine's handoffs only after its lease
and READ timeout (``PrefillServer``, with a stand-in engine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import jaxmamba
from jaxmamba.engine.disagg import DecodeEngine, Handoff, PrefillServer, RemoteDisaggregation, RemotePrefill
from jaxmamba.errors import ConfigError, RequestError, TransferError
from transfer.control import ControlClient, ControlServer, advertised_address, parse_address
from transfer.nixl_bridge import RequestPages, nixl_available

REPO = Path(__file__).resolve().parents[2]
COMPILE_CACHE = os.environ.get("JAXMAMBA_TEST_COMPILE_CACHE", str(REPO / ".jax_cache"))
requires_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not importable (install the 'nixl' extra)")

ENGINE_ARGS = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8, buckets=[(2, 32)])
ENGINE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                "--block-size", "8", "--buckets", "2,32", "--dtype", "float32", "--quiet"]
PROMPT_LENS = (17, 9, 30, 2, 1, 45)
PROMPTS = [np.random.default_rng(5).integers(3, 500, size=n).tolist() for n in PROMPT_LENS]
MAX_TOKENS = 8
STATUSES = ["imported" if n > 1 else "local" for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(jaxmamba.random_model("nemotron_h", "tiny", seed=11, path=tmp_path_factory.mktemp("remote") / "g1",
                                     n_groups=1))


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    from jaxmamba import LLM, SamplingParams

    outs = LLM(model, **ENGINE_ARGS).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", JAXMAMBA_COMPILE_CACHE=COMPILE_CACHE,
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _jaxmamba(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmamba", *args]


def _network_device() -> str:
    """A network interface that is up other than loopback (UCX's choice on one host is ``lo``), else ``lo``."""
    net = Path("/sys/class/net")
    for dev in sorted(net.iterdir()) if net.is_dir() else ():
        if dev.name != "lo" and (dev / "operstate").exists() and (dev / "operstate").read_text().strip() == "up":
            return dev.name
    return "lo"


class PrefillProcess:
    """``python -m jaxmamba serve-prefill`` in a process of its own; ``address`` from its ready line, ``lines``
    its stdout (where NIXL and UCX log too)."""

    def __init__(self, model: str, listen: str = "127.0.0.1:0", timeout_s: float = 600.0, flags=(), env=None):
        self.proc = subprocess.Popen(_jaxmamba("serve-prefill", model, "--kv-listen", listen, "--engine-id", "P",
                                               "--staging-requests", "8", *ENGINE_FLAGS, *flags),
                                     cwd=REPO, env=dict(_env(), **(env or {})), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        ready_lines: list[str] = []
        ready = threading.Event()

        def read() -> None:  # keeps the pipe drained; the ready line carries the address
            for line in self.proc.stdout:
                self.lines.append(line)
                if "ready: decode engines pass --kv-peer" in line:
                    ready_lines.append(line)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or not ready_lines:
            self.close()
            raise AssertionError(f"serve-prefill did not start: {self.lines} {self.proc.stderr.read()}")
        self.address = ready_lines[0].rsplit("--kv-peer", 1)[1].strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the server closes its engine and exits 0
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def prefill(model):
    proc = PrefillProcess(model)
    yield proc
    proc.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_staged(address: str, want: int, timeout_s: float = 10.0) -> dict:
    peer = RemotePrefill(address, lease_s=1.0, read_timeout_s=1.0)
    try:
        deadline = time.monotonic() + timeout_s
        while (state := peer.state())["staged"] != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return state
    finally:
        peer.close()


# ============================================================================ two processes
@pytest.mark.nixl
@requires_nixl
def test_generate_with_remote_prefill_matches_single_engine(model, reference):
    """One command per host: the decode process is given the prefill process's address and nothing else. Both
    sides name the network device UCX moves pages over (``--ucx-devices``), and UCX's log shows it did."""
    device = _network_device()
    ucx = ["--ucx-devices", device]
    prefill = PrefillProcess(model, flags=ucx, env={"UCX_LOG_LEVEL": "info"})
    try:
        prompt_args = [a for p in PROMPTS for a in ("--prompt", " ".join(map(str, p)))]
        done = subprocess.run(_jaxmamba("generate", model, "--kv-peer", prefill.address, "--json", "--ignore-eos",
                                        "--max-tokens", str(MAX_TOKENS), *ENGINE_FLAGS, *ucx, *prompt_args),
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
        check_remote_generate(done, reference, prefill)
        endpoints = [line for line in prefill.lines if "intra-node cfg" in line or "inter-node cfg" in line]
        assert endpoints and all(f"tcp/{device}" in line for line in endpoints), endpoints
        if device != "lo":
            assert not any("tcp/lo" in line for line in endpoints), endpoints
    finally:
        prefill.close()


def check_remote_generate(done: subprocess.CompletedProcess, reference, prefill: PrefillProcess) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in results] == reference
    assert [r["transfer"]["status"] for r in results] == STATUSES, [r["transfer"] for r in results]
    assert all(r["transfer"]["error"] is None for r in results)
    # Every page was READ and notified: the prefill engine staged nothing and holds nothing.
    state = _wait_staged(prefill.address, 0)
    assert (state["staged"], state["slots_in_use"], state["blocks_in_use"], state["held"]) == (0, 0, 0, 0), state


@pytest.mark.nixl
@requires_nixl
def test_a_decode_engine_over_two_processes_matches_single_engine(model, reference, prefill):
    """D at TP=2 over two jax.distributed processes (one virtual CPU device each), P one process: one command
    per D process, each given P's address. Process 0 holds the control channel; each process READs the pages
    of its own rank; both print the single engine's tokens, every prompt imported, and P frees everything."""
    for done in _generate_processes(model, prefill.address, 2):
        check_remote_generate(done, reference, prefill)


@pytest.mark.nixl
@requires_nixl
def test_prefill_engine_lost_between_requests_falls_back(model, reference, prefill):
    """D in this process, P in its own. Served; then a lease too short to READ in; then P killed between its
    handoffs and D's READs; then P unreachable. Each time the prompts are computed here with the same tokens,
    the records say why (naming P's address once it is gone), and D is left clean."""
    from jaxmamba import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    decode = DecodeEngine(LLM(model, **ENGINE_ARGS), name="D", timeout_s=5.0)
    remote = RemoteDisaggregation(decode, prefill.address, connect_timeout_s=5.0)
    try:
        def run(prompts) -> list[dict]:
            outs = remote.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == reference[: len(prompts)]
            decode.llm.check_invariants()
            assert (decode.llm.stats.slots_in_use, decode.llm.stats.blocks_in_use) == (0, 0)
            assert (decode.staging.num_used_slots, decode.staging.num_quarantined) == (0, 0)
            return [decode.transfers[o.request_id] for o in outs]

        assert [r.status for r in run(PROMPTS)] == STATUSES

        remote.lease_s = 1e-6  # every handoff's lease runs out before its READ
        records = run(PROMPTS[:3])
        assert all(r.status == "fallback" and "expired before its READ" in r.error for r in records), records
        assert _wait_staged(prefill.address, 0)["staged"] == 0  # D released what it did not read
        remote.lease_s = 60.0

        # P dies after handing off, before D READs: the READs fail, the release finds P gone.
        handed_off = remote.peer.prefill

        def prefill_then_die(prompt_ids):
            handoffs = handed_off(prompt_ids)
            prefill.proc.kill()
            prefill.proc.wait(10)
            return handoffs

        remote.peer.prefill = prefill_then_die
        t0 = time.monotonic()
        records = run(PROMPTS[:3])
        assert all(r.status == "fallback" and "READ from prefill engine 'P' failed" in r.error for r in records)
        assert remote.peer is None and decode.connected == ()
        assert "failed during 'release'" in remote.peer_error and prefill.address in remote.peer_error

        records = run(PROMPTS[:3])  # dials again: nothing listens
        assert time.monotonic() - t0 < 120
        assert all(r.status == "fallback" and f"cannot reach the peer at {prefill.address}" in r.error
                   for r in records), records
        assert remote.peer is None and decode.connected == ()
    finally:
        remote.close()
        decode.close()


#: A process of a multi-process side: one virtual CPU device (XLA_FLAGS as tests/jaxmamba/test_distributed.py).
ONE_DEVICE = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"}


def _generate_processes(model: str, address: str, num_processes: int) -> list[subprocess.CompletedProcess]:
    """``generate --kv-peer address`` as one process, or as ``num_processes`` at TP=``num_processes`` (one
    virtual CPU device each); each one's completed run."""
    prompt_args = [a for p in PROMPTS for a in ("--prompt", " ".join(map(str, p)))]
    command = _jaxmamba("generate", model, "--kv-peer", address, "--json", "--ignore-eos", "--max-tokens",
                        str(MAX_TOKENS), *ENGINE_FLAGS, *prompt_args)
    if num_processes == 1:
        return [subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)]
    flags = ["--tensor-parallel-size", str(num_processes), "--coordinator-address", f"127.0.0.1:{_free_port()}",
             "--num-processes", str(num_processes)]
    env = dict(_env(), **ONE_DEVICE)
    procs = [subprocess.Popen([*command, *flags, "--process-id", str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(num_processes)]
    try:
        streams = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, streams, strict=True)]


@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("d_processes", [1, 2], ids=["D1", "D2"])
def test_a_prefill_engine_over_two_processes_serves_decode_engines(model, reference, d_processes):
    """The mirror: P at TP=2 over two jax.distributed processes (one virtual CPU device each; process 0 serves
    the control channel, process 1 replays its prefills), D one process at TP=1 reading both P ranks, or
    both sides over two processes: the single engine's tokens, every prompt imported, nothing left staged
    on process 0 of P."""
    flags = ["--tensor-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{_free_port()}",
             "--num-processes", "2"]
    follower = subprocess.Popen(_jaxmamba("serve-prefill", model, "--kv-listen", "127.0.0.1:0", "--engine-id", "P",
                                          "--staging-requests", "8", *ENGINE_FLAGS, *flags, "--process-id", "1"),
                                cwd=REPO, env=dict(_env(), **ONE_DEVICE), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    leader = None
    try:
        leader = PrefillProcess(model, flags=[*flags, "--process-id", "0"], env=ONE_DEVICE)
        for done in _generate_processes(model, leader.address, d_processes):
            check_remote_generate(done, reference, leader)
    finally:
        if leader is not None:
            leader.close()
        try:
            assert follower.wait(60) == 0, follower.stderr.read()[-3000:]  # the leader's close stops it
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(10)


class SecondProcess:
    """Stands in for process 1 of a two-process decode engine in ``DecodeEngine``'s agreements
    (``ProcessGather.gather``): it answers each round with this process's value changed by ``answer``."""

    def __init__(self, answer):
        self.answer, self.rounds = answer, []

    def gather(self, payload: bytes) -> list[bytes]:
        mine = json.loads(payload)
        self.rounds.append(mine["subject"])
        return [payload, json.dumps(self.answer(dict(mine))).encode()]


@pytest.mark.nixl
@requires_nixl
def test_a_read_failing_on_another_process_falls_back_here_too(model, reference, prefill):
    """Over several processes a request is imported everywhere or nowhere: here every READ succeeds, the other
    process's fails, so every request falls back here as well (the record names that process), with the
    single engine's tokens, nothing left staged on either side. Another handoff at the same point is a
    ``ProcessesDisagree``."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.parallel.distributed import ProcessesDisagree

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    decode = DecodeEngine(LLM(model, **ENGINE_ARGS), name="D", timeout_s=5.0)

    def read_fails(v: dict) -> dict:
        if v["subject"].endswith(" done"):
            v["error"] = "READ of rank 1 timed out"
        return v

    decode._gather = other = SecondProcess(read_fails)
    remote = RemoteDisaggregation(decode, prefill.address, connect_timeout_s=5.0)
    try:
        outs = remote.generate(PROMPTS[:3], params)
        assert [o.outputs[0].token_ids for o in outs] == reference[:3]
        records = [decode.transfers[o.request_id] for o in outs]
        assert all(r.status == "fallback" and "process 1: READ of rank 1 timed out" in r.error for r in records)
        assert other.rounds[0].startswith("connect to 'P'") and len(other.rounds) == 1 + 2 * 3, other.rounds
        assert (decode.staging.num_used_slots, decode.staging.num_quarantined) == (0, 0)
        assert _wait_staged(prefill.address, 0)["staged"] == 0

        decode._gather = SecondProcess(lambda v: dict(v, subject=v["subject"].replace("READ handoff", "READ other")))
        with pytest.raises(ProcessesDisagree, match="process 1: READ other"):
            remote.generate(PROMPTS[:1], params)
    finally:
        remote.close()
        decode.close()


@pytest.mark.nixl
@requires_nixl
def test_a_prefill_engine_waits_while_another_process_has_no_staging_room(model):
    """Over several processes a request is staged everywhere or nowhere: the other process's pool is full, so
    this one (with room) stages nothing and gives its pages back; the other process gives up waiting first,
    so this one gives up too, long before its own ``staging_wait_s``; the handoff says why."""
    from jaxmamba import LLM
    from jaxmamba.engine.disagg import PrefillEngine

    engine = PrefillEngine(LLM(model, **ENGINE_ARGS), engine_id="P", progress_thread=False)
    try:
        free_slots = engine.staging.num_free_slots

        def full_and_done_waiting(v: dict) -> dict:
            return dict(v, got=False) if v["subject"].startswith("stage") else dict(v, waited=True)

        engine._gather = other = SecondProcess(full_and_done_waiting)
        t0 = time.monotonic()
        (handoff,) = engine.prefill([PROMPTS[0]], staging_wait_s=600.0)
        assert time.monotonic() - t0 < 60
        assert handoff.pages is None and "staging pool full" in handoff.error, handoff
        assert other.rounds[0].startswith("stage") and other.rounds[-1] == "staging wait", other.rounds
        assert (engine.num_staged, engine.staging.num_free_slots) == (0, free_slots)
        assert not engine.llm.scheduler.held and not engine.llm.scheduler.has_work
    finally:
        engine.close()


# ============================================================================ addresses and faults
def test_unreachable_peer_raises_transfer_error_within_timeout():
    port = _free_port()  # bound, then closed: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=f"cannot reach the peer at 127.0.0.1:{port} within 2 s"):
        RemotePrefill(f"127.0.0.1:{port}", lease_s=1.0, read_timeout_s=1.0, connect_timeout_s=2.0)
    assert time.monotonic() - t0 < 5

    with socket.socket() as silent:  # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=f"peer at {address} did not answer 'hello' within 1 s"):
            RemotePrefill(address, lease_s=1.0, read_timeout_s=1.0, connect_timeout_s=1.0)
        assert time.monotonic() - t0 < 5


def test_generate_cli_names_an_unreachable_or_malformed_peer(model):
    port = _free_port()
    for peer, match in ((f"127.0.0.1:{port}", f"error: cannot reach the peer at 127.0.0.1:{port} within 2 s"),
                        ("prefill-host", "error: peer address 'prefill-host' must be HOST:PORT")):
        done = subprocess.run(_jaxmamba("generate", model, "--kv-peer", peer, "--kv-connect-timeout", "2"),
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and match in done.stderr, done.stderr


@pytest.mark.parametrize("text,match", [
    ("localhost", "must be HOST:PORT"), (":8000", "must be HOST:PORT"), ("", "must be HOST:PORT"),
    ("host:http", "the port must be an integer"), ("host:70000", "the port must be an integer"),
    ("host:0", r"the port must be an integer in \[1, 65535\]"), ("::1:8000", "IPv6 host in brackets"),
    ("[::1]8000", r"must be \[IPv6\]:PORT"), ("[nothost]:80", "is not an IPv6 address"),
    ("http://host:80", "is not a host name"), ("a b:80", "is not a host name"),
])
def test_bad_peer_addresses_raise_config_error(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_address(text, what="peer address")
    with pytest.raises(ConfigError, match=match):  # before dialling anything
        ControlClient(text)


def test_addresses_parse_and_advertise():
    assert parse_address("10.1.2.3:7000") == ("10.1.2.3", 7000)
    assert parse_address("[fe80::1]:7000") == ("fe80::1", 7000)
    assert parse_address("prefill-0.cluster.local:0", allow_port_zero=True) == ("prefill-0.cluster.local", 0)
    assert advertised_address("10.1.2.3", 7000) == "10.1.2.3:7000"
    assert advertised_address("0.0.0.0", 7000, "10.1.2.3") == "10.1.2.3:7000"
    assert advertised_address("::", 7000, "fe80::1") == "[fe80::1]:7000"
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="cannot advertise"):
            advertised_address(host, 7000)
    with pytest.raises(ConfigError, match="cannot advertise"):
        ControlServer("0.0.0.0:0", lambda c, m: {})
    server = ControlServer("0.0.0.0:0", lambda c, m: {}, advertise_host="127.0.0.1")
    try:
        assert server.address == f"127.0.0.1:{server.port}" and server.port > 0
    finally:
        server.close()
    port = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            ControlServer(f"127.0.0.1:{port}", lambda c, m: {})


def test_serve_prefill_cli_refuses_bad_addresses():
    for flags, match in ((["--kv-listen", "nowhere"], "error: --kv-listen 'nowhere' must be HOST:PORT"),
                         (["--kv-listen", "0.0.0.0:0"], "error: cannot advertise '0.0.0.0'")):
        done = subprocess.run(_jaxmamba("serve-prefill", "no-such-checkpoint", *flags), cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and match in done.stderr, done.stderr


# ============================================================================ the channel and the lease
class _Polling:
    """Polls a server on a thread until closed (the server itself is single-threaded)."""

    def __init__(self, poll):
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                poll()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_control_channel_replies_errors_and_disconnects():
    dropped = []

    def handle(conn_id: int, message: dict) -> dict:
        if message["op"] == "fail":
            raise RequestError("no such prompt")
        return {"echo": message, "conn": conn_id}

    server = ControlServer("127.0.0.1:0", handle, on_disconnect=dropped.append)
    polling = _Polling(lambda: server.poll(0.01))
    try:
        client = ControlClient(server.address, timeout_s=5.0)
        assert client.call("echo", value=[1, "x"])["echo"] == {"op": "echo", "value": [1, "x"]}
        with pytest.raises(RequestError, match=f"peer at {server.address} failed 'fail': no such prompt"):
            client.call("fail")
        assert client.call("echo")["conn"] == 0  # a reported failure leaves the connection usable
        client.close()
        deadline = time.monotonic() + 5
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped == [0]
        with pytest.raises(TransferError, match="is closed"):
            client.call("echo")
    finally:
        polling.close()
        server.close()


class _StandInEngine:
    """What ``PrefillServer`` needs of a ``PrefillEngine``: every prompt becomes one staged handoff."""

    engine_id, tp, local_ranks = "P", 1, (0,)

    def __init__(self):
        self.staged: set[str] = set()
        self.n = 0
        self.llm = SimpleNamespace(stats=SimpleNamespace(slots_in_use=0, blocks_in_use=0),
                                   scheduler=SimpleNamespace(held={}))

    def directories(self) -> list[bytes]:
        return [b'{"directory": 0}']

    def prefill(self, prompts) -> list[Handoff]:
        out = []
        for ids in prompts:
            self.n += 1
            handoff_id = f"P/{self.n}"
            self.staged.add(handoff_id)
            out.append(Handoff("P", tuple(ids), len(ids) - 1, RequestPages(handoff_id)))
        return out

    def poll(self) -> list[str]:
        return []

    def is_staged(self, handoff_id: str) -> bool:
        return handoff_id in self.staged

    def release(self, handoff_id: str) -> None:
        self.staged.discard(handoff_id)

    @property
    def num_staged(self) -> int:
        return len(self.staged)


def test_prefill_server_frees_a_lost_decode_engines_handoffs_after_its_lease():
    """Pages a decode engine was handed and never read nor released stay staged while it is connected, and
    after its connection ends until its lease plus READ timeout have passed (it may still be READing)."""
    engine = _StandInEngine()
    server = PrefillServer(engine, "127.0.0.1:0")
    polling = _Polling(lambda: server.poll(0.005))
    try:
        with pytest.raises(TransferError, match="'prefill' before 'hello'"):
            ControlClient(server.address).call("prefill", prompts=[[1, 2]])
        peer = RemotePrefill(server.address, lease_s=0.6, read_timeout_s=0.4)
        assert peer.engine_id == "P" and peer.directories == [b'{"directory": 0}']
        with pytest.raises(RequestError, match="list of non-empty lists of token ids"):
            peer.client.call("prefill", prompts=[[1, "2"]])
        handoffs = peer.prefill([[1, 2, 3], [4, 5]])
        assert [h.handoff_id for h in handoffs] == ["P/1", "P/2"]
        assert peer.release(["P/1"]) == 1
        time.sleep(1.2)
        assert engine.staged == {"P/2"}  # connected: never freed on a timer
        peer.close()
        t0 = time.monotonic()
        while engine.staged and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        waited = time.monotonic() - t0
        assert engine.staged == set() and 0.9 <= waited < 5, waited
        with pytest.raises(TransferError, match="protocol 2 is not"):
            ControlClient(server.address).call("hello", protocol=2, lease_s=1, read_timeout_s=1)
    finally:
        polling.close()
        server.close()
