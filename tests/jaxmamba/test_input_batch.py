"""The persistent input batch (jaxmamba.engine.input_batch): per-request sampling inputs written once per
row owner, gathered by the step; a row that changes hands carries only its new request's inputs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxmamba import LLM, SamplingParams, random_model
from jaxmamba.engine.block_table import NULL_ROW
from jaxmamba.engine.input_batch import InputBatch
from jaxmamba.engine.request import Request
from jaxmamba.errors import SlotError
from jaxmamba.sampling import MAX_BANNED_IDS


def _request(rid: str, seed: int, ban=(), **params) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(**params), seed=seed, arrival=0, min_tokens_ban=tuple(ban))


def test_rows_hold_their_requests_inputs_and_padding_reads_the_fills():
    batch = InputBatch(5)
    a = _request("a", 11, ban=(2, 9), temperature=0.7, top_p=0.5, top_k=4, min_p=0.1, min_tokens=2, logprobs=3)
    b = _request("b", -3, temperature=0.0)
    batch.assign(np.array([3, 1], np.int32), [a, b])
    rows = np.array([3, 1, NULL_ROW, NULL_ROW])  # two real rows, padded to a bucket of four
    np.testing.assert_allclose(batch.temperature[rows], [0.7, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(batch.top_p[rows], [0.5, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(batch.min_p[rows], [0.1, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(batch.top_k[rows], [4, 0, 0, 0])
    np.testing.assert_array_equal(batch.seed[rows], [11, -3, 0, 0])
    np.testing.assert_array_equal(batch.min_tokens[rows], [2, 0, 0, 0])
    np.testing.assert_array_equal(batch.wants_logprobs[rows], [True, False, False, False])
    expected_ban = np.full((4, MAX_BANNED_IDS), -1)
    expected_ban[0, :2] = (2, 9)
    np.testing.assert_array_equal(batch.ban_ids[rows], expected_ban)
    assert batch.num_assigned == 2


def test_a_row_is_written_once_per_owner_and_fully_rewritten_when_it_changes_hands():
    batch = InputBatch(3)
    a = _request("a", 1, ban=(4, 5, 6), temperature=0.9, top_k=7, min_tokens=3)
    batch.assign(np.array([1]), [a])
    batch.assign(np.array([1]), [a])  # the same request again: nothing written
    assert batch.num_assigned == 1
    c = _request("c", 2, ban=(8,), temperature=0.0)  # takes a's row: none of a's inputs may remain
    batch.assign(np.array([1]), [c])
    assert batch.num_assigned == 2
    assert (batch.temperature[1], batch.top_k[1], batch.seed[1], batch.min_tokens[1]) == (0.0, 0, 2, 0)
    np.testing.assert_array_equal(batch.ban_ids[1], [8] + [-1] * (MAX_BANNED_IDS - 1))
    batch.forget()  # after a table reset: the next assign rewrites even the same owner
    batch.assign(np.array([1]), [c])
    assert batch.num_assigned == 3


def test_gather_pads_with_the_fills_and_reuses_its_answer_only_for_the_same_frozen_rows_and_writes():
    """``gather`` (each step): the rows' inputs padded with ``NULL_ROW``'s fills. The same read-only ``row_map``
    object at the same padding with no row written since gets the last answer back (decoding's steady state);
    a write, another padding, another array or a writable one (which its owner may change in place) is
    gathered anew."""
    batch = InputBatch(5)
    a = _request("a", 11, ban=(2, 9), temperature=0.7, top_k=4, min_tokens=2, logprobs=3)
    b = _request("b", -3, temperature=0.0)
    batch.assign(np.array([3, 1]), [a, b])
    row_map = np.array([1, 3], np.int32)
    row_map.flags.writeable = False
    first = batch.gather(row_map, 4)
    assert first.row_maps.tolist() == [1, 3, NULL_ROW, NULL_ROW]
    np.testing.assert_array_equal(first.ints, [[0, 4, 0, 0], [-3, 11, 0, 0], [0, 2, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_allclose(first.floats, [[0.0, 0.7, 0.0, 0.0], [1.0] * 4, [0.0] * 4])
    assert first.ban_ids.reshape(4, MAX_BANNED_IDS)[1, :3].tolist() == [2, 9, -1]
    assert first.random and first.wants_logprobs
    assert not any(x.flags.writeable for x in (first.row_maps, first.ints, first.floats, first.ban_ids))
    assert batch.gather(row_map, 4) is first
    assert batch.gather(row_map, 2).row_maps.tolist() == [1, 3]
    assert batch.gather(row_map, 4) is not first  # the last answer is the padding-2 one now

    greedy = batch.gather(row_map[:1], 2)  # b alone: greedy, no logprobs
    assert not greedy.random and not greedy.wants_logprobs
    frozen = np.array([3], np.int32)
    frozen.flags.writeable = False
    before = batch.gather(frozen, 2)
    batch.assign(np.array([3]), [_request("c", 5, temperature=0.0)])  # c takes a's row
    after = batch.gather(frozen, 2)
    assert after is not before and after.ints[0, 0] == 0 and not after.random

    writable = np.array([1], np.int32)
    assert batch.gather(writable, 2).row_maps[0] == 1
    writable[0] = 3  # changed in place by its owner: gathered anew
    assert batch.gather(writable, 2).row_maps[0] == 3


@pytest.mark.parametrize("row", [NULL_ROW, 3, -1])
def test_the_null_row_and_rows_outside_the_batch_are_refused(row):
    batch = InputBatch(3)
    with pytest.raises(SlotError, match="null row or outside"):
        batch.assign(np.array([row]), [_request("a", 1)])


def test_rows_reused_by_requests_with_other_params_sample_as_fresh_engines(tmp_path):
    """One row, four requests in turn with different temperatures, seeds, top-k and min_tokens: each request's
    tokens equal those of an engine that served only it (stale inputs in the reused row would change them)."""
    ckpt = random_model("nemotron_h", path=tmp_path / "ckpt")
    args = dict(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64)
    prompts = [[5, 9, 13, 2], [7, 7, 3], [11, 4, 6, 8, 1], [3, 10]]
    params = [SamplingParams(temperature=1.0, seed=3, top_k=5, max_tokens=6, min_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, top_p=0.7, max_tokens=6),
              SamplingParams(temperature=1.2, seed=1, min_p=0.2, max_tokens=6)]
    llm = LLM(ckpt, **args)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.input_batch.num_assigned == len(prompts)  # every request took the one row in turn
    alone = []
    for prompt, p in zip(prompts, params):
        alone += [o.outputs[0].token_ids for o in LLM(ckpt, **args).generate([prompt], [p])]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(prompts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_only_the_sampled_ids_come_back_unless_a_row_asks_for_logprobs(tmp_path, async_scheduling):
    """The full sampling tail computes logprobs for every batch; the host reads them back only for a batch
    in which some request asked for them."""
    ckpt = random_model("nemotron_h", path=tmp_path / "ckpt")
    llm = LLM(ckpt, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, sampling_variants="full",
              async_scheduling=async_scheduling)
    read = []
    real = llm.runner._result

    def spy(order, outputs, bucket, num_decodes):
        read.append(outputs[2] is not None)
        return real(order, outputs, bucket, num_decodes)

    llm.runner._result = spy
    prompts = [[5, 9, 13, 2], [7, 7, 3]]
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    outs = llm.generate(prompts, plain)
    assert read and not any(read)
    assert all(o.outputs[0].logprobs is None for o in outs)
    read.clear()
    outs = llm.generate(prompts, [plain, SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=2)])
    assert read and all(read)
    assert outs[0].outputs[0].logprobs is None and len(outs[1].outputs[0].logprobs) == 4
