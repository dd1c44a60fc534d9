"""Engine-level P/D disaggregation (``jaxmamba.engine.disagg``) with real NIXL READs between processes.

A prefill ``LLM`` (TP = P_TP) and a decode ``LLM`` (TP = D_TP) run in separate spawned processes
(``EngineProcess``; ``XLA_FLAGS=--xla_force_host_platform_device_count`` set for each), this pytest
process drives them over pipes and relays handoffs and directories. The oracle is one TP=1 engine
in this process. Greedy tokens must be identical, except that after a near-tie (top-2 logit gap
< ``NEAR_TIE`` = 1e-4 in the reference, from its top-2 logprobs: the gap of log-softmax values is
the logit gap) the rest may differ: the engines at different TP sizes sum in different orders.

Models: random NemotronH tiny (layers ``M*M-``: 2 Mamba2 layers with 8 heads x 16, d_state 16;
1 attention layer with 4 heads and 2 KV heads, so TP=4 replicates each KV head on 2 ranks), with
``n_groups`` 1 (replicated on every rank when TP > 1) and 4 (sharded up to TP=4). Prompts of
17, 9, 30, 2, 1 and 45 tokens with block_size 8: N-1 = 16 (whole blocks), 8, 29 (a partial last
block), 1 (a single prefilled token), a one-token prompt (nothing to transfer: computed on D) and
a 45-token prompt (chunked prefill on P).

The default run covers 1/2 (every D rank reads a slice of one P page: the 3-read) and 4/2 (each
D rank gathers from two P ranks; KV heads replicated on P) for both models; the other ratios are
``slow``. Faults (a killed P process, a frozen one, READs NIXL refuses, READs of a P engine that
closed and unmapped its staging, a P engine or a handoff whose pages do not fit) must each fall
back to computing the prompt on D with unchanged tokens, record the error, and leave no slot,
staging page or registration behind.
Compilation dominates: every engine uses one bucket and shares the persistent compile cache
(``JAXMAMBA_TEST_COMPILE_CACHE`` or ``.jax_cache``) with this process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hf_reference import assert_greedy_match

import jaxmamba
from jaxmamba.config import HybridConfig
from jaxmamba.engine.disagg import (
    DecodeEngine,
    EngineProcess,
    Handoff,
    PrefillEngine,
    decode_process_main,
    prefill_process_main,
)
from jaxmamba.errors import ConfigError, RequestError, TransferError
from jaxmamba.layout import kv_cache_shape, page_size_bytes
from jaxmamba.random_checkpoint import random_config_dict
from transfer.nixl_bridge import PageDirectory, RequestPages, nixl_available

REPO = Path(__file__).resolve().parents[2]
COMPILE_CACHE = os.environ.get("JAXMAMBA_TEST_COMPILE_CACHE", str(REPO / ".jax_cache"))
requires_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not importable (install the 'nixl' extra)")

ENGINE_ARGS = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8, buckets=[(2, 32)])
MODELS = {"g1": dict(n_groups=1), "g4": dict(n_groups=4)}
SEEDS = {"g1": 11, "g4": 12}
PROMPT_LENS = (17, 9, 30, 2, 1, 45)
PROMPTS = [np.random.default_rng(5).integers(3, 500, size=n).tolist() for n in PROMPT_LENS]
PARAMS = dict(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
IMPORTED = [n > 1 for n in PROMPT_LENS]  # a one-token prompt has nothing computed before its last token
DEFAULT_RATIOS = [(1, 2), (4, 2)]
SLOW_RATIOS = [(1, 4), (2, 4), (2, 1), (4, 1)]


def ratio_id(ratio) -> str:
    return f"P{ratio[0]}D{ratio[1]}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("disagg-models")
    return {key: str(jaxmamba.random_model("nemotron_h", "tiny", seed=SEEDS[key], path=root / key, **over))
            for key, over in MODELS.items()}


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list[tuple[list[int], np.ndarray]]]:
    """Per model and prompt: the TP=1 engine's greedy tokens and top-2 logprobs per step ``[steps, 2]``."""
    from jaxmamba import LLM, SamplingParams

    out = {}
    for key, path in models.items():
        outs = LLM(path, **ENGINE_ARGS).generate(PROMPTS, SamplingParams(**PARAMS))
        out[key] = [(o.outputs[0].token_ids, np.array([sorted(step.values()) for step in o.outputs[0].logprobs]))
                    for o in outs]
    return out


def _process_spec(tp: int, engines: dict) -> dict:
    env = {"JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}".strip()}
    return {"env": env, "compile_cache": COMPILE_CACHE, "engines": engines}


def start_prefill(models, tp: int, tag: str, keys=tuple(MODELS)) -> EngineProcess:
    """A prefill process at TP=``tp`` with one engine per model key, engine ids ``f"{tag}-{key}"``."""
    engines = {key: {"model": models[key], "engine_id": f"{tag}-{key}",
                     "engine_args": dict(ENGINE_ARGS, tensor_parallel_size=tp), "staging_requests": 8}
               for key in keys}
    return EngineProcess(prefill_process_main, _process_spec(tp, engines))


class Cluster:
    """Engine processes started on first use and shared by the module's tests: prefill ``P{tp}`` and
    decode ``D{tp}`` processes, each with one engine per model."""

    def __init__(self, models):
        self.models = models
        self.prefills: dict[int, EngineProcess] = {}
        self.decodes: dict[int, EngineProcess] = {}
        self.links: set[tuple[int, int, str]] = set()

    def prefill(self, tp: int) -> EngineProcess:
        if tp not in self.prefills:
            self.prefills[tp] = start_prefill(self.models, tp, f"P{tp}")
        return self.prefills[tp]

    def decode(self, tp: int) -> EngineProcess:
        if tp not in self.decodes:
            engines = {key: {"model": self.models[key], "name": f"D{tp}-{key}", "timeout_s": 10.0,
                             "engine_args": dict(ENGINE_ARGS, tensor_parallel_size=tp)} for key in MODELS}
            self.decodes[tp] = EngineProcess(decode_process_main, _process_spec(tp, engines))
        return self.decodes[tp]

    def pair(self, p_tp: int, d_tp: int, key: str) -> tuple[EngineProcess, EngineProcess]:
        """The P and D processes for a ratio, D's ``key`` engine connected to P's."""
        prefill, decode = self.prefill(p_tp), self.decode(d_tp)
        if (p_tp, d_tp, key) not in self.links:
            assert decode.call("connect", key, prefill.ready[key]) is None
            self.links.add((p_tp, d_tp, key))
        return prefill, decode

    def close(self) -> None:
        for proc in [*self.prefills.values(), *self.decodes.values()]:
            proc.close()


@pytest.fixture(scope="module")
def cluster(models):
    c = Cluster(models)
    yield c
    c.close()


def expected_bytes(key: str, d_tp: int, prompt_len: int) -> int:
    """Bytes all D ranks READ for one request (f32 caches), from jaxmamba.layout, not the plans."""
    cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "tiny", **MODELS[key]))
    mamba = len(cfg.mamba_layer_ids) * page_size_bytes(cfg, d_tp, conv_dtype="float32", ssm_dtype="float32")
    _, _, bs, kv_local, hd = kv_cache_shape(1, ENGINE_ARGS["block_size"], cfg.num_key_value_heads, cfg.head_dim,
                                            d_tp)
    blocks = math.ceil((prompt_len - 1) / bs)
    kv = len(cfg.attention_layer_ids) * blocks * 2 * bs * kv_local * hd * 4  # K and V
    return d_tp * (mamba + kv)


def check_outputs(result: dict, reference, what: str) -> None:
    """Greedy tokens as the TP=1 engine's (near-tie rule), and nothing left behind on the D engine."""
    assert result["errors"] == [None] * len(PROMPTS)
    for i, (tokens, (ref_tokens, ref_top2)) in enumerate(zip(result["outputs"], reference)):
        assert_greedy_match(tokens, ref_tokens, ref_top2, f"{what} prompt {i} ({PROMPT_LENS[i]} tokens)")
    assert result["invariants"] == ""
    assert (result["slots_in_use"], result["blocks_in_use"]) == (0, 0)
    assert (result["staging_in_use"], result["staging_quarantined"]) == (0, 0)
    assert result["compiles_while_serving"] == 0


def wait_staged(prefill: EngineProcess, want: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
    """P's count of handoffs still staged, once it reaches ``want`` (notifications arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        staged = prefill.call("poll")
        if staged == want or time.monotonic() > deadline:
            return staged
        time.sleep(0.02)


def run_disaggregated(cluster, reference, p_tp: int, d_tp: int, key: str) -> None:
    prefill, decode = cluster.pair(p_tp, d_tp, key)
    handoffs = prefill.call("prefill", key, PROMPTS)
    parsed = [Handoff.from_bytes(h) for h in handoffs]
    assert [h.num_computed_tokens for h in parsed] == [n - 1 if n > 1 else 0 for n in PROMPT_LENS]
    result = decode.call("generate", key, handoffs, PARAMS)
    check_outputs(result, reference[key], f"P_TP={p_tp} D_TP={d_tp} {key}")
    for n, imported, record in zip(PROMPT_LENS, IMPORTED, result["transfers"]):
        assert record["status"] == ("imported" if imported else "local"), record
        assert record["error"] is None
        if imported:
            assert record["bytes_read"] == expected_bytes(key, d_tp, n)
    assert result["abandoned"] == []
    # Every reader notified every P rank it read, so P freed all staging pages; its engine holds nothing.
    assert wait_staged(prefill, {k: 0 for k in MODELS}) == {k: 0 for k in MODELS}
    assert prefill.call("state")[key] == dict(slots_in_use=0, blocks_in_use=0, held=0, staged=0, invariants="")


# ============================================================================ token identity
@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("key", list(MODELS))
@pytest.mark.parametrize("p_tp,d_tp", DEFAULT_RATIOS, ids=[ratio_id(r) for r in DEFAULT_RATIOS])
def test_disaggregated_greedy_matches_single_engine(cluster, reference, p_tp, d_tp, key):
    run_disaggregated(cluster, reference, p_tp, d_tp, key)


@pytest.mark.slow
@pytest.mark.nixl
@requires_nixl
@pytest.mark.parametrize("key", list(MODELS))
@pytest.mark.parametrize("p_tp,d_tp", SLOW_RATIOS, ids=[ratio_id(r) for r in SLOW_RATIOS])
def test_disaggregated_greedy_matches_single_engine_all_ratios(cluster, reference, p_tp, d_tp, key):
    run_disaggregated(cluster, reference, p_tp, d_tp, key)


# ============================================================================ faults
def check_fallback(result: dict, reference, what: str, match: str) -> None:
    """Every prefilled request fell back with an error naming the fault; outputs are unchanged."""
    check_outputs(result, reference, what)
    for imported, record in zip(IMPORTED, result["transfers"]):
        if imported:
            assert record["status"] == "fallback" and match in record["error"], record
        else:
            assert record["status"] == "local", record
    assert len(result["abandoned"]) == sum(IMPORTED)


@pytest.mark.nixl
@requires_nixl
def test_dead_prefill_peer_falls_back(models, cluster, reference):
    decode = cluster.decode(2)
    base = decode.call("registrations")
    prefill = start_prefill(models, 1, "dead", keys=("g1",))
    try:
        assert decode.call("connect", "g1", prefill.ready["g1"]) is None
        assert decode.call("registrations") > base
        handoffs = prefill.call("prefill", "g1", PROMPTS)
        prefill.proc.kill()
        prefill.proc.join(10)
        result = decode.call("generate", "g1", handoffs, PARAMS, 5.0)
        check_fallback(result, reference["g1"], "dead peer", "READ from prefill engine 'dead-g1' failed")
        # No leaked registration: closing the dead engine's importers deregisters every staging page.
        assert decode.call("disconnect", "g1", "dead-g1") == base
    finally:
        prefill.close()


@pytest.mark.nixl
@requires_nixl
def test_read_timeout_falls_back_and_peer_recovers(models, cluster, reference):
    """P frozen (SIGSTOP): a READ with a completion notification cannot complete."""
    decode = cluster.decode(2)
    base = decode.call("registrations")
    prefill = start_prefill(models, 1, "stopped", keys=("g1",))
    try:
        assert decode.call("connect", "g1", prefill.ready["g1"]) is None
        handoffs = prefill.call("prefill", "g1", PROMPTS)
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            result = decode.call("generate", "g1", handoffs, PARAMS, 0.5)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        check_fallback(result, reference["g1"], "timeout", "READ from prefill engine 'stopped-g1' failed")
        errors = [r["error"] for r in result["transfers"] if r["status"] == "fallback"]
        # The first READ times out and drops the peer; the others then fail before posting anything.
        assert "did not complete within 0.5 s" in errors[0] and all("not connected" in e for e in errors[1:])
        assert elapsed < 60
        # P frees what D gave up on; after a reconnect the same P serves again.
        assert prefill.call("release", "g1", result["abandoned"]) == {"g1": 0}
        assert decode.call("connect", "g1", prefill.ready["g1"]) is None
        again = decode.call("generate", "g1", prefill.call("prefill", "g1", PROMPTS), PARAMS, 10.0)
        check_outputs(again, reference["g1"], "after recovery")
        assert [r["status"] for r in again["transfers"]] == ["imported" if i else "local" for i in IMPORTED]
        assert wait_staged(prefill, {"g1": 0}) == {"g1": 0}
        assert decode.call("disconnect", "g1", "stopped-g1") == base
    finally:
        prefill.close()


@pytest.mark.nixl
@requires_nixl
def test_failed_reads_fall_back(models, cluster, reference):
    """Two READs that fail with the peer alive: NIXL refuses one whose remote pages are not registered
    memory (a directory pointing 1 GiB off), and after P closed its engine (staging deregistered and
    unmapped) the READ of its outstanding handoffs fails."""
    decode = cluster.decode(2)
    base = decode.call("registrations")
    prefill = start_prefill(models, 1, "failing", keys=("g1",))
    try:
        off = []
        for raw in prefill.ready["g1"]:
            d = PageDirectory.from_bytes(raw)
            off.append(dataclasses.replace(d, mamba=tuple(dataclasses.replace(r, conv_addr=r.conv_addr + (1 << 30))
                                                          for r in d.mamba)).to_bytes())
        assert decode.call("connect", "g1", off) is None  # sizes agree: only NIXL can tell
        result = decode.call("generate", "g1", prefill.call("prefill", "g1", PROMPTS), PARAMS, 5.0)
        check_fallback(result, reference["g1"], "unregistered", "READ from prefill engine 'failing-g1' failed")
        assert "preparing the READ from P rank 0" in result["transfers"][0]["error"]
        assert prefill.call("release", "g1", result["abandoned"]) == {"g1": 0}

        assert decode.call("connect", "g1", prefill.ready["g1"]) is None  # the true directories
        handoffs = prefill.call("prefill", "g1", PROMPTS)
        assert prefill.call("unmap", "g1") == "unmapped"
        result = decode.call("generate", "g1", handoffs, PARAMS, 5.0)
        check_fallback(result, reference["g1"], "closed", "READ from prefill engine 'failing-g1' failed")
        assert decode.call("disconnect", "g1", "failing-g1") == base
        assert prefill.call("close") == ("closed", 0)
    finally:
        prefill.close()


@pytest.mark.nixl
@requires_nixl
def test_page_size_mismatch_falls_back(cluster, reference):
    """A D engine refuses a P engine whose pages are another size (here: another n_groups), and a handoff
    whose pages do not fit its model; those requests compute their prompts on D."""
    prefill, decode = cluster.pair(1, 2, "g1")
    base = decode.call("registrations")
    error = decode.call("connect", "g1", prefill.ready["g4"])
    assert "cannot read from prefill engine 'P1-g4'" in error and "page size mismatch" in error, error
    assert decode.call("registrations") == base  # the refused connection registered nothing

    result = decode.call("generate", "g1", prefill.call("prefill", "g4", PROMPTS), PARAMS)
    check_fallback(result, reference["g1"], "mismatch", "page size mismatch")
    assert prefill.call("release", "g4", result["abandoned"]) == {"g1": 0, "g4": 0}

    # From the matching engine, a handoff missing a KV block: refused before any READ.
    handoffs = [Handoff.from_bytes(h) for h in prefill.call("prefill", "g1", PROMPTS)]
    bad = handoffs[0]
    kv = {layer: blocks[:-1] for layer, blocks in bad.pages.kv.items()}
    handoffs[0] = Handoff(bad.engine_id, bad.prompt_token_ids, bad.num_computed_tokens,
                          RequestPages(bad.pages.request_id, bad.pages.mamba, kv))
    result = decode.call("generate", "g1", [h.to_bytes() for h in handoffs], PARAMS)
    check_outputs(result, reference["g1"], "tampered handoff")
    records = result["transfers"]
    assert records[0]["status"] == "fallback" and "do not fit this model" in records[0]["error"]
    assert [r["status"] for r in records[1:]] == ["imported" if i else "local" for i in IMPORTED[1:]]
    assert result["abandoned"] == [bad.pages.request_id]
    prefill.call("release", "g1", result["abandoned"])
    assert wait_staged(prefill, {"g1": 0, "g4": 0}) == {"g1": 0, "g4": 0}


# ============================================================================ in-process pieces
def test_scheduler_holds_finished_request_until_release(models):
    """``Scheduler.hold_on_finish``: a finished request keeps its KV blocks and state slot (the invariants
    count it as a holder) until ``release_held``."""
    from jaxmamba import LLM, SamplingParams

    llm = LLM(models["g1"], **ENGINE_ARGS)
    req = llm.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
    llm.scheduler.hold_on_finish.add(req.request_id)
    finished = []
    while llm.scheduler.has_work:
        finished += llm.step()
        llm.check_invariants()
    assert finished == [req] and req.finish_reason == "length"
    assert llm.scheduler.held == {req.request_id: req} and not llm.scheduler.hold_on_finish
    blocks = llm.kv.kv_block_ids(req.request_id)
    assert len(blocks) == math.ceil(len(PROMPTS[0]) / ENGINE_ARGS["block_size"])
    assert (llm.stats.slots_in_use, llm.stats.blocks_in_use) == (1, len(blocks))
    llm.scheduler.release_held(req.request_id)
    llm.check_invariants()
    assert (llm.stats.slots_in_use, llm.stats.blocks_in_use) == (0, 0)
    with pytest.raises(RequestError, match="is not held"):
        llm.scheduler.release_held(req.request_id)


def test_handoff_round_trip_and_malformed():
    pages = RequestPages("P1-g1/4", mamba={"layers.0.mixer": (3,)}, kv={"layers.1.attn": (1, 5)})
    h = Handoff("P1-g1", (5, 6, 7), 2, pages)
    assert Handoff.from_bytes(h.to_bytes()) == h and h.handoff_id == "P1-g1/4"
    local = Handoff("P1-g1", (9,))
    assert Handoff.from_bytes(local.to_bytes()) == local and local.handoff_id is None
    for bad in (b"{", b'{"engine_id": "x"}', b'{"engine_id": "x", "prompt_token_ids": ["a"], '
                                              b'"num_computed_tokens": 0, "error": null, "pages": null}'):
        with pytest.raises(TransferError, match="malformed handoff"):
            Handoff.from_bytes(bad)


def test_engines_need_cache_mode_none():
    llm = SimpleNamespace(kv=SimpleNamespace(cache_mode="align"))
    with pytest.raises(ConfigError, match="mamba_cache_mode='none'"):
        PrefillEngine(llm, engine_id="P")
    with pytest.raises(ConfigError, match="mamba_cache_mode='none'"):
        DecodeEngine(llm)


@requires_nixl
@pytest.mark.nixl
def test_pages_round_trip_through_the_caches(models):
    """One ``LLM`` plays P, D and P again: ``DecodeEngine.import_now`` READs a prefill's pages and installs them
    into the caches without a step, ``PrefillEngine.stage_request`` copies them out again: every staged conv,
    SSM and KV byte equals what the prefill staged (30 tokens: a partial last block). ``import_now`` refuses a
    handoff with nothing to import, and a queue it would overtake, leaving nothing behind."""
    from jaxmamba import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(models["g1"], **ENGINE_ARGS)
    prefill = PrefillEngine(llm, engine_id="P")
    decode = DecodeEngine(llm, name="D")
    try:
        decode.connect(prefill.directories())
        handoff, one_token = prefill.prefill([PROMPTS[2], PROMPTS[4]])
        req = decode.import_now(handoff, params)
        assert decode.transfers[req.request_id].status == "imported"
        again = prefill.stage_request(req, handoff.prompt_token_ids, handoff.num_computed_tokens)
        llm.abort_request([req.request_id])
        llm.check_invariants()
        assert (llm.stats.slots_in_use, llm.stats.blocks_in_use) == (0, 0)
        (slot,), (slot_again,) = next(iter(handoff.pages.mamba.values())), next(iter(again.pages.mamba.values()))
        blocks, blocks_again = list(next(iter(handoff.pages.kv.values()))), list(next(iter(again.pages.kv.values())))
        assert slot != slot_again and len(blocks) == len(blocks_again) == 4
        staging = prefill.staging
        for i in range(len(prefill.mamba_layers)):
            assert staging.conv[0][i][slot_again].tobytes() == staging.conv[0][i][slot].tobytes(), f"conv {i}"
            assert staging.ssm[0][i][slot_again].tobytes() == staging.ssm[0][i][slot].tobytes(), f"ssm {i}"
        for j in range(len(prefill.kv_layers)):
            assert staging.kv[0][j][:, blocks_again].tobytes() == staging.kv[0][j][:, blocks].tobytes(), f"kv {j}"
        with pytest.raises(TransferError, match="could not import handoff None: nothing was prefilled"):
            decode.import_now(one_token, params)
        assert not llm.scheduler.has_work
        decode.add_request(handoff, params)  # queued, not imported yet
        with pytest.raises(RequestError, match="empty import queue"):
            decode.import_now(handoff, params)
    finally:
        decode.close()
        prefill.close()
