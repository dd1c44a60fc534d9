"""Where jaxmamba can follow either peer (vLLM or transformers) exactly.

dt clamp: transformers' NemotronH clamps ``softplus(dt + dt_bias)`` from below at ``time_step_min``;
vLLM's ``MambaMixer2`` passes ``dt_limit=(0, inf)`` to its kernels whatever the config says. With
``dt_clamp="vllm"`` the engine (and its draft model) computes vLLM's numbers, by default transformers'
(the torch comparison tests hold the default to transformers' tokens).

``mamba_cache_mode="align"`` with ``max_num_batched_tokens < block_size``: vLLM's
``Scheduler._mamba_block_aligned_split`` lets a block wider than the budget advance in sub-block chunks
that re-align at its end; jaxmamba refused such engines.
"""

from __future__ import annotations

import json
import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.errors import ConfigError
from jaxmamba.model import ops
from jaxmamba.model.greedy import greedy_generate
from jaxmamba.model.layers import Mamba2Mixer
from jaxmamba.weights import with_dt_clamp

PROMPTS = [[5, 9, 33, 2, 71, 8, 15], [300, 4], [12, 12, 12, 90, 41, 7, 7, 66, 3, 28, 19]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def clamped(tmp_path_factory):
    """A NemotronH whose time_step_min binds for most heads (softplus(dt + bias) is mostly below 0.5)."""
    return random_model("nemotron_h", path=tmp_path_factory.mktemp("n") / "ckpt", time_step_min=0.5)


def test_vllm_dt_clamp_is_vllms_numbers(clamped):
    model = load_pretrained(clamped)
    assert model.cfg.mamba_time_step_limit == (0.5, math.inf)  # transformers' reading of the config
    vllm_model = with_dt_clamp(model, "vllm")
    assert vllm_model.cfg.mamba_time_step_limit == (0.0, math.inf)
    ref_default, _ = greedy_generate(model, PROMPTS, 6)
    ref_vllm, _ = greedy_generate(vllm_model, PROMPTS, 6)
    default = LLM(clamped, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64).generate(PROMPTS, PARAMS)
    vllm = LLM(clamped, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
               dt_clamp="vllm").generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in default] == ref_default
    assert [o.outputs[0].token_ids for o in vllm] == ref_vllm
    # The clamp binds here, so the two peers' numbers differ: the option is not a no-op.
    first = lambda outs: np.array([float(next(iter(o.outputs[0].logprobs[0].values()))) for o in outs])  # noqa: E731
    assert np.abs(first(default) - first(vllm)).max() > 1e-3


def test_dt_clamp_is_checked_and_a_no_op_where_the_peers_agree(clamped, tmp_path):
    with pytest.raises(ConfigError, match="dt_clamp='torch' must be one of"):
        LLM(clamped, dt_clamp="torch")
    mamba2 = load_pretrained(random_model("mamba2", path=tmp_path / "m2"))
    assert mamba2.cfg.mamba_time_step_limit == (0.0, math.inf)
    assert with_dt_clamp(mamba2, "vllm") is mamba2


def test_align_mode_takes_a_token_budget_below_the_block_size(tmp_path):
    """vLLM accepts mamba_cache_mode='align' with max_num_batched_tokens < block_size (jaxmamba refused it):
    a block wider than any chunk is prefilled in sub-block chunks that re-align at its end. Tokens equal
    mode none's, states are cached only at block ends (the second wave hits them), invariants hold."""
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 500, 40).tolist()
    prompts = [shared + rng.integers(3, 500, n).tolist() for n in (3, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = dict(max_num_seqs=2, max_num_batched_tokens=12, block_size=32, max_model_len=96, buckets=[(2, 12)])
    plain = LLM(path, **engine).generate(prompts, params)
    align = LLM(path, enable_prefix_caching=True, mamba_cache_mode="align", **engine)
    steps = []
    schedule = align.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(r.request.num_computed_tokens, r.num_tokens) for r in out.rows])
        return out

    align.scheduler.schedule = spy
    first = align.generate(prompts, params)
    align.check_invariants()
    # Prompt chunks before the last block end never cross a block end (12 tokens, then 12, then 8 to 32).
    chunks = [(c, n) for rows in steps for c, n in rows if c + n <= 32]
    assert all((c // 32) == ((c + n - 1) // 32) for c, n in chunks) and (24, 8) in chunks
    second = align.generate(prompts, params)  # the 32-token block of the shared prefix is cached now
    align.check_invariants()
    assert align.stats.num_prefix_hit_tokens >= 2 * 32
    want, _ = greedy_generate(load_pretrained(path), prompts, 5)
    for outs in (plain, first, second):
        assert [o.outputs[0].token_ids for o in outs] == want


def test_each_dt_clamp_matches_its_peer(tmp_path):
    """The two clamps against independent references: transformers on the checkpoint (``time_step_min``
    binds) for the default, and transformers on the same weights with ``time_step_min=0`` -- a clamp at 0
    of a softplus is no clamp, i.e. vLLM's ``dt_limit=(0, inf)`` -- for ``dt_clamp="vllm"``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import assert_greedy_match, hf_checkpoint, hf_greedy

    checkpoint = hf_checkpoint(tmp_path, "nemotron_h", time_step_min=0.5)
    vllm_peer = tmp_path / "vllm-peer"
    shutil.copytree(checkpoint, vllm_peer)
    config = json.loads((vllm_peer / "config.json").read_text())
    config["time_step_min"] = 0.0
    (vllm_peer / "config.json").write_text(json.dumps(config))

    first_logits = {}
    for dt_clamp, peer in (("checkpoint", checkpoint), ("vllm", vllm_peer)):
        outs = LLM(checkpoint, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                   dt_clamp=dt_clamp).generate(PROMPTS, PARAMS)
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
            ref_tokens, ref_logits = hf_greedy(peer, prompt, PARAMS.max_tokens)
            ours = out.outputs[0].token_ids
            assert_greedy_match(ours, ref_tokens, ref_logits, f"dt_clamp={dt_clamp} prompt {i}")
            # The first token's logprob is the prefill's: the peer's log-softmax, to float32 rounding.
            ref_logprobs = ref_logits[0] - np.logaddexp.reduce(ref_logits[0].astype(np.float64))
            assert abs(float(out.outputs[0].logprobs[0][ours[0]]) - ref_logprobs[ours[0]]) < 1e-4
            first_logits[dt_clamp, i] = ref_logits[0]
    # The peers disagree here (the comparison above is not vacuous).
    assert max(np.abs(first_logits["checkpoint", i] - first_logits["vllm", i]).max() for i in range(3)) > 1e-2


def test_draft_model_follows_the_dt_clamp(clamped):
    """vLLM runs a draft model through the same MambaMixer2, so dt_clamp='vllm' reaches the draft too;
    greedy speculative decoding stays lossless (vLLM's numbers, as without a draft)."""
    spec = {"method": "draft_model", "model": str(clamped), "num_speculative_tokens": 2}
    llm = LLM(clamped, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, dt_clamp="vllm",
              speculative_config=spec)
    assert llm.proposer.cfg.mamba_time_step_limit == (0.0, math.inf)
    want, _ = greedy_generate(with_dt_clamp(load_pretrained(clamped), "vllm"), PROMPTS, 6)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == want


def test_serve_cli_takes_dt_clamp(monkeypatch):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from jaxmamba import cli

    seen = {}
    monkeypatch.setattr(cli, "_needs", lambda *a: None)
    monkeypatch.setattr(cli, "_checkpoint", lambda checkpoint, family: "ckpt")
    monkeypatch.setattr("jaxmamba.serve.serve", lambda model, **kw: seen.update(kw, model=model))
    assert cli.main(["serve", "--dt-clamp", "vllm"]) == 0
    assert seen["model"] == "ckpt" and seen["dt_clamp"] == "vllm"
    assert cli.build_parser().parse_args(["serve"]).dt_clamp == "checkpoint"


def test_generate_cli_takes_dt_clamp(monkeypatch):
    import jaxmamba
    from jaxmamba import cli

    seen = {}

    def llm(path, **kwargs):  # stops cmd_generate once the engine's arguments are known
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(cli, "_checkpoint", lambda checkpoint, family: "ckpt")
    monkeypatch.setattr(jaxmamba, "LLM", llm)
    assert cli.main(["generate", "--dt-clamp", "vllm", "--quiet"]) == 2 and seen["dt_clamp"] == "vllm"
    assert cli.main(["generate", "--quiet"]) == 2 and seen["dt_clamp"] == "checkpoint"


@pytest.mark.parametrize("block_size", [8, 16])
def test_align_chunks_with_a_budget_below_the_block_size(block_size):
    """``align_prefill_chunk`` for every budget, prompt length and block-end resume point: with the whole
    budget a prefill always progresses (no stall); before the last cacheable block end no chunk crosses a
    block end, so every state taken there is a block-end state; with a budget below the block size every
    block end up to the last cacheable one is a chunk end (a state is taken at each), as vLLM's
    ``_mamba_block_aligned_split`` with ``max_num_batched_tokens < block_size``."""
    from jaxmamba.engine.prefix_cache import PrefixCacheManager

    bs = block_size
    for budget in range(1, 2 * bs + 1):
        pm = PrefixCacheManager(64, 64, bs, "align", 0, max_model_len=6 * bs, max_num_batched_tokens=budget)
        for num_tokens in range(1, 5 * bs + 1):
            last = (num_tokens - 1) // bs * bs
            for start in range(0, num_tokens, bs):
                c, ends = start, []
                while c < num_tokens:
                    n = pm.align_prefill_chunk(c, num_tokens, min(budget, num_tokens - c))
                    assert 0 < n <= budget, (budget, num_tokens, c, n)
                    if c + n <= last:
                        if budget < bs:  # sub-block chunks: none crosses a block end
                            assert c // bs == (c + n - 1) // bs, (budget, num_tokens, c, n)
                        else:  # as before: whole blocks, ending on a block end
                            assert (c + n) % bs == 0, (budget, num_tokens, c, n)
                    c += n
                    ends.append(c)
                if budget < bs:
                    assert set(range(start + bs, last + 1, bs)) <= set(ends), (budget, num_tokens, start, ends)
                elif start < last:
                    assert last in ends
    # A budget that could reach a block end but has not this step (other requests took the rest) waits.
    pm = PrefixCacheManager(64, 64, bs, "align", 0, max_model_len=6 * bs, max_num_batched_tokens=bs)
    assert pm.align_prefill_chunk(0, 4 * bs, bs - 1) == 0
    # With the budget below the block size the same leftover progresses inside the block instead.
    pm = PrefixCacheManager(64, 64, bs, "align", 0, max_model_len=6 * bs, max_num_batched_tokens=bs - 1)
    assert pm.align_prefill_chunk(0, 4 * bs, bs - 1) == bs - 1


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2}], ids=["plain", "ngram"])
def test_align_with_a_small_budget_survives_preemption_and_sharing(tmp_path, spec):
    """Sub-block prefill chunks (budget 6 < block 16) next to decodes, prefix hits and preemptions (a
    7-block pool for three 50-token requests): tokens stay the model's own greedy ones and the engine's
    invariants hold after every step."""
    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 500, 20).tolist()
    prompts = [shared + rng.integers(3, 500, n).tolist() for n in (2, 7, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="align", max_num_seqs=3, max_num_batched_tokens=6,
              block_size=16, num_blocks=8, max_model_len=64, buckets=[(3, 6)],
              **({"speculative_config": spec} if spec else {}))
    want, logits = greedy_generate(load_pretrained(path), prompts, 16)
    from hf_reference import assert_greedy_match

    for wave in range(2):  # the second wave starts from the first one's cached block-end states
        reqs = [llm.add_request(p, params) for p in prompts]
        while llm.scheduler.has_work:
            llm.step()
            llm.check_invariants()
        for i, (r, w, lg) in enumerate(zip(reqs, want, logits)):
            assert_greedy_match(r.output_token_ids, w, lg, f"wave {wave} request {i}")
    s = llm.stats
    assert s.num_preemptions > 0, "the pool was meant to force preemption"
    assert s.num_prefix_hit_tokens > 0


_TP_SCRIPT = """
import json, sys
from jaxmamba import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, buckets=[(4, 32)])
out = {}
for name, kw in (("tp1", {}), ("tp2", {"tensor_parallel_size": 2})):
    for dt_clamp in ("checkpoint", "vllm"):
        outs = LLM(sys.argv[1], dt_clamp=dt_clamp, **kw, **args).generate(prompts, params)
        out[name + "-" + dt_clamp] = [[o.outputs[0].token_ids, [float(lp[t]) for lp, t in
                                       zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]] for o in outs]
print(json.dumps(out))
"""


def test_dt_clamp_reaches_tensor_parallel_ranks(clamped):
    """Under TP the ranks run a graph rebuilt from the config (``parallel.local_graphdef``): each clamp
    gives the TP=1 engine's tokens and logprobs at TP=2, and the two clamps differ there too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(clamped), json.dumps(PROMPTS)], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for dt_clamp in ("checkpoint", "vllm"):
        for (tok1, lp1), (tok2, lp2) in zip(r["tp1-" + dt_clamp], r["tp2-" + dt_clamp]):
            assert tok1 == tok2, dt_clamp
            assert np.abs(np.array(lp1) - np.array(lp2)).max() < 1e-4, dt_clamp
    first = {c: np.array([lps[0] for _, lps in r["tp2-" + c]]) for c in ("checkpoint", "vllm")}
    assert np.abs(first["checkpoint"] - first["vllm"]).max() > 1e-3


@pytest.mark.parametrize("family", ["nemotron_h", "nemotron_h_moe"])
def test_vllm_clamp_rebuild_keeps_every_weight(tmp_path, family):
    """``with_dt_clamp`` rebuilds the model from its parameters: its logits equal those of the same
    checkpoint whose config clamps at 0 (``time_step_min=0``, i.e. no clamp), MoE experts included."""
    import jax.numpy as jnp

    path = random_model(family, path=tmp_path / "ckpt", time_step_min=0.5)
    unclamped = tmp_path / "unclamped"
    shutil.copytree(path, unclamped)
    config = json.loads((unclamped / "config.json").read_text())
    config["time_step_min"] = 0.0
    (unclamped / "config.json").write_text(json.dumps(config))
    ids = jnp.asarray([PROMPTS[2]], jnp.int32)
    rebuilt = with_dt_clamp(load_pretrained(path), "vllm")
    want = np.asarray(load_pretrained(unclamped)(ids))
    np.testing.assert_array_equal(np.asarray(rebuilt(ids)), want)
    assert np.abs(np.asarray(load_pretrained(path)(ids)) - want).max() > 1e-3


def test_discretize_dt_is_numpys_clamp_for_either_peer():
    """ops.discretize_dt against plain numpy: softplus(dt + bias) clamped below at time_step_min
    (transformers' NemotronH) or at 0 (vLLM), the two differing exactly where softplus < time_step_min."""
    rng = np.random.default_rng(0)
    dt = rng.normal(-4.0, 3.0, (3, 50, 8)).astype(np.float32)
    bias = rng.normal(0.0, 1.0, 8).astype(np.float32)
    softplus = np.logaddexp(0.0, (dt + bias).astype(np.float64))
    lo = float(np.quantile(softplus, 0.3))  # binds for ~30% of the elements
    transformers = np.asarray(ops.discretize_dt(dt, bias, (lo, math.inf)))
    vllm = np.asarray(ops.discretize_dt(dt, bias, (0.0, math.inf)))
    np.testing.assert_allclose(transformers, np.maximum(softplus, lo), rtol=1e-6)
    np.testing.assert_allclose(vllm, softplus, rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(transformers != vllm, softplus < lo)


def _softplus_dt(model, ids: list[int]) -> np.ndarray:
    """numpy softplus(dt + dt_bias) [mamba layers, T, H] of ``model``'s own forward over ``ids`` (unclamped)."""
    found = []

    def record(mixer, normed):
        _, _, dt = mixer.project_in(normed)
        found.append(np.asarray(dt[0], np.float64) + np.asarray(mixer.dt_bias[...], np.float64))
        return Mamba2Mixer.__call__(mixer, normed)

    hidden = model.embed_tokens(jnp.asarray([ids]))
    for layer in model.layers:
        hidden = layer(hidden, mamba_fn=record)
    return np.logaddexp(0.0, np.stack(found))


def test_the_clamps_change_logits_from_the_first_position_numpy_predicts(tmp_path):
    """A NemotronH whose time_step_min binds first at prompt position P (found with numpy from vLLM's
    unclamped dt): its logits equal vLLM's clamp's before P and differ from P on (a clamp is causal)."""
    vllm_model = with_dt_clamp(load_pretrained(random_model("nemotron_h", path=tmp_path / "free")), "vllm")
    vocab = list(range(3, 500))
    # Layer 0's dt depends on the current token only: lead with tokens whose dt is large, then the smallest.
    order = np.array(vocab)[np.argsort(_softplus_dt(vllm_model, vocab)[0].min(axis=-1))]
    first_bind = 10
    prompt = order[::-1][:first_bind].tolist() + [int(order[0])] + order[::-1][first_bind : first_bind + 5].tolist()
    per_position = _softplus_dt(vllm_model, prompt).min(axis=(0, 2))  # [T]: the smallest dt of any layer/head
    time_step_min = float(per_position[:first_bind].min())
    assert per_position[first_bind] < 0.8 * time_step_min  # the clamp binds there, by a margin
    path = random_model("nemotron_h", path=tmp_path / "clamped", time_step_min=time_step_min)  # same weights
    transformers_model = load_pretrained(path)
    assert transformers_model.cfg.mamba_time_step_limit == (time_step_min, math.inf)
    diff = np.abs(np.asarray(transformers_model(jnp.asarray([prompt])))[0]
                  - np.asarray(with_dt_clamp(transformers_model, "vllm")(jnp.asarray([prompt])))[0]).max(axis=-1)
    assert diff[:first_bind].max() <= 1e-6, diff
    assert diff[first_bind:].min() > 1e-6, diff


def test_align_with_a_small_budget_through_eviction_and_mid_block_preemption(tmp_path):
    """The sub-block path where the pool is tighter than in the test above: a 6-token budget against 16-token
    blocks, n-gram drafts (decode rows of 3 tokens eat into the budget, so prefill chunks get any size), and a
    6-block pool that preempts a request part-way through a block and evicts a cached block-end state. Every step keeps the invariants, tokens
    equal the cache-free model's, later waves still hit the cache, and the pools end empty."""
    from hf_reference import assert_greedy_match

    path = random_model("nemotron_h", path=tmp_path / "ckpt")
    llm = LLM(path, enable_prefix_caching=True, mamba_cache_mode="align", max_num_seqs=3, max_num_batched_tokens=6,
              block_size=16, num_blocks=6, max_model_len=64, buckets=[(3, 6)],
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    rng = np.random.default_rng(5)
    motif = rng.integers(3, 500, 4).tolist()
    shared = (motif * 6)[:21] + rng.integers(3, 500, 14).tolist()  # 35 tokens: two whole blocks and a bit
    waves = [[shared[:n] + rng.integers(3, 500, k).tolist() for n, k in ((35, 3), (20, 9), (33, 2))],
             [shared + rng.integers(3, 500, k).tolist() for k in (1, 6)] + [shared[:32]]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    preempted_at = []
    preempt = llm.scheduler._preempt

    def spy(req):
        preempted_at.append(req.num_computed_tokens)
        return preempt(req)

    llm.scheduler._preempt = spy
    reqs = []
    for wave in waves:
        reqs += [llm.add_request(p, params) for p in wave]
        while llm.scheduler.has_work:
            llm.step()
            llm.check_invariants()
    s = llm.stats
    assert s.num_preemptions > 0, "the pools were meant to force preemption"
    assert any(c % 16 for c in preempted_at), f"no request was preempted inside a block: {preempted_at}"
    assert s.num_prefix_hit_tokens > 0 and s.num_draft_tokens > 0 and llm.kv.stats.num_kv_evictions > 0
    assert s.slots_in_use == 0 and s.blocks_in_use == 0
    want, logits = greedy_generate(llm.model, [r.prompt_token_ids for r in reqs], 10)
    for i, (r, w, lg) in enumerate(zip(reqs, want, logits)):
        assert_greedy_match(r.output_token_ids, w, lg, f"align, small budget: request {i}")
