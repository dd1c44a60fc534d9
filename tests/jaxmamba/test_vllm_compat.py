"""Where jaxmamba can follow either peer exactly (issue 16 item 6): vLLM's dt clamp.

transformers' NemotronH clamps ``softplus(dt + dt_bias)`` from below at ``time_step_min``; vLLM's
``MambaMixer2`` passes ``dt_limit=(0, inf)`` to its kernels whatever the config says. With
``dt_clamp="vllm"`` the engine computes vLLM's numbers, by default transformers' (the torch comparison
tests hold the default to transformers' tokens).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, load_pretrained, random_model
from jaxmamba.errors import ConfigError
from jaxmamba.model.greedy import greedy_generate
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
