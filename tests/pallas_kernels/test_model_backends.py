"""The model end to end: backend="pallas" (interpreted on CPU) generates what backend="reference" does."""

from __future__ import annotations

import pytest

import jaxmamba
from jaxmamba import LLM, SamplingParams


@pytest.mark.parametrize("family", ["nemotron_h"])
def test_pallas_backend_matches_reference_end_to_end(tmp_path, family):
    path = jaxmamba.random_model(family=family, size="tiny", seed=0, path=tmp_path / family)
    # 23 tokens with 16 per step: chunked prefill, so the second chunk starts from saved conv/SSM states.
    prompts = [list(range(5, 28)), [3, 4, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * len(prompts)
    tokens = {}
    for backend in ("reference", "pallas"):
        llm = LLM(path, kernel_backend=backend, max_model_len=48, max_num_seqs=2, max_num_batched_tokens=16,
                  buckets=[(2, 16)])
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.stats.backend_compiles_since_warmup == 0
    assert tokens["pallas"] == tokens["reference"]
