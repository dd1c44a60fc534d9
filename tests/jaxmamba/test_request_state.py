"""A request's per-row state in the step loop: what every step reads of each row is shared or inline, so that a
row visits as few objects of its own as it can (beside a CPU device each is a cache miss a step)."""

from __future__ import annotations

import pytest

from jaxmamba.engine.request import Request, SamplingParams


@pytest.fixture(scope="module")
def step_loop():
    from jaxmamba.bench.host_inputs import stubbed_llm

    return stubbed_llm(max_num_seqs=4, max_num_batched_tokens=64).engine_core.step_loop


def _request(rid: str, max_outputs: int, **params) -> Request:
    req = Request(rid, [5, 6, 7], SamplingParams(**params), seed=0, arrival=0)
    req.max_outputs = max_outputs
    return req


def test_requests_with_equal_stop_rules_share_one_rule_and_every_rule_one_tuple_of_stop_ids(step_loop):
    a, b, c = _request("a", 8), _request("b", 8), _request("c", 9)
    rule_a, rule_b, rule_c = (step_loop._stop_rule(r) for r in (a, b, c))
    assert rule_a == (tuple(step_loop.cfg.eos_token_id), 8, False) and rule_c[1:] == (9, False)
    assert rule_a is rule_b and rule_a is a.stop_rule is b.stop_rule
    assert rule_c is not rule_a and rule_c[0] is rule_a[0], "the stop ids are one tuple for every rule"
    ignoring = step_loop._stop_rule(_request("d", 8, ignore_eos=True))
    assert ignoring == ((), 8, False)
    general = step_loop._stop_rule(_request("e", 8, stop_token_ids=[3]))
    assert general[2] and general[0] is rule_a[0], "stop ids of the request's own go through _record_row"


def test_a_request_without_drafts_holds_the_shared_empty_tuple_and_its_prompt_length():
    a, b = _request("a", 8), _request("b", 8)
    assert a.draft_token_ids == () and a.draft_token_ids is b.draft_token_ids
    assert a.num_prompt_tokens == len(a.prompt_token_ids) == 3

