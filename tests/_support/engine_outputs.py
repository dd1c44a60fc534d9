"""Engine-parity helpers: run ``LLM.generate`` and compare two engines' outputs request by request
(tokens, finish and stop reasons exactly; logprob ranks exactly and values to 1e-5: two engines may run a
step in different buckets, and padding changes the order of float sums)."""

from __future__ import annotations

import numpy as np


def random_prompts(lens, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in lens]


def engine_outputs(llm, prompts, params) -> list[list[tuple]]:
    """Per request, per sample: ``(token_ids, finish_reason, stop_reason, logprobs)``; the engine must end idle,
    consistent, and without compiling while it served."""
    compiles = llm.stats.backend_compiles_since_warmup  # process-wide: other engines' warm-ups count too
    outs = llm.generate(prompts, params)
    llm.check_invariants()
    assert not llm.has_unfinished_requests() and llm._inflight is None
    assert llm.stats.backend_compiles_since_warmup == compiles, "compiled while serving"
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def assert_same_outputs(got, expected) -> None:
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        for (tokens, reason, stop, lps), (tokens_b, reason_b, stop_b, lps_b) in zip(a, b, strict=True):
            assert (tokens, reason, stop) == (tokens_b, reason_b, stop_b), f"request {i}"
            assert (lps is None) == (lps_b is None)
            for x, y in zip(lps or [], lps_b or [], strict=True):
                assert x.keys() == y.keys() and [v.rank for v in x.values()] == [v.rank for v in y.values()]
                np.testing.assert_allclose(list(x.values()), list(y.values()), rtol=0, atol=1e-5)
