"""``MixedStepWriter.write_mixed`` writes exactly the buffer the metadata builders pack for every batch of decode
rows and prompt chunks it takes, and refuses (None) every batch it does not take or whose values the builders
would reject, so that their errors still name it."""

import numpy as np
import pytest

from jaxmamba.errors import MetadataError, SlotError
from jaxmamba.metadata import build_common_metadata, build_mamba_metadata, pack
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS
from jaxmamba.metadata.mixed_step import MixedStepWriter

SEPARATE = ("block_table", *DEVICE_SLOT_FIELDS)


def _builders(computed, scheduled, prompt, rows, block_table, state_table, *, R, T, P, bs, mml, num_blocks,
              num_slots, cs, warmup=False):
    n = len(computed)
    common = build_common_metadata(
        num_reqs=n, num_computed_tokens=computed, num_scheduled_tokens=scheduled, num_prompt_tokens=prompt,
        block_table=block_table, block_table_rows=rows, block_size=bs, num_reqs_padded=R, num_tokens_padded=T,
        max_model_len=mml, num_blocks=num_blocks, warmup=warmup)
    mamba = build_mamba_metadata(common, state_indices=state_table, cache_mode="none", block_size=bs,
                                 num_speculative_blocks=0, chunk_size=cs, num_slots=num_slots,
                                 num_prefills_padded=P, state_indices_rows=rows)
    return pack(common, mamba, separate=SEPARATE), int(mamba.num_decodes)


class _Bucket:
    def __init__(self, R, T, P, bs=4, mml=96, cs=8, num_blocks=500, num_slots=300):
        self.R, self.T, self.P, self.bs, self.mml, self.cs = R, T, P, bs, mml, cs
        self.num_blocks, self.num_slots, self.columns, self.table_rows = num_blocks, num_slots, -(-mml // bs), R + 1
        one = np.array([1], np.int32)
        self.layout = self.build(one, one, one, one, np.ones((self.table_rows, self.columns), np.int32),
                                 np.ones((self.table_rows, 1), np.int32), warmup=True)[0].layout
        self.writer = MixedStepWriter.for_bucket(
            self.layout, num_reqs_padded=R, num_tokens_padded=T, num_prefills_padded=P, separate=SEPARATE,
            block_size=bs, max_model_len=mml, num_blocks=num_blocks, num_slots=num_slots, chunk_size=cs,
            block_table_columns=self.columns, cache_mode="none", num_spec=0)
        assert self.writer is not None

    def build(self, *args, warmup=False):
        return _builders(*args, R=self.R, T=self.T, P=self.P, bs=self.bs, mml=self.mml, num_blocks=self.num_blocks,
                         num_slots=self.num_slots, cs=self.cs, warmup=warmup)

    def check(self, computed, scheduled, prompt, rows, block_table, state_table):
        """The writer's buffer and decode count equal the builders'; returns the decode count."""
        args = [np.asarray(a, np.int32) for a in (computed, scheduled, prompt, rows)] + [block_table, state_table]
        expected, num_decodes = self.build(*args)
        got = self.writer.write_mixed(*args)
        assert got is not None
        np.testing.assert_array_equal(got[0], expected.buffer)
        assert got[0].dtype == np.int32 and got[1] == num_decodes
        return num_decodes


def _random_batch(rng, b: _Bucket):
    """Decode rows, then long extends, then fresh prompts (the builders' order), within the bucket."""
    while True:
        n = int(rng.integers(1, b.R + 1))
        num_prefills = int(rng.integers(0, min(b.P, n) + 1))
        nd = n - num_prefills
        num_extends = int(rng.integers(0, num_prefills + 1))
        prompt = rng.integers(1, b.mml // 2, n)
        computed = np.empty(n, np.int64)
        scheduled = np.ones(n, np.int64)
        computed[:nd] = prompt[:nd] + rng.integers(0, b.mml // 2 - 1, nd)  # decodes: past their prompts
        for i in range(nd, n):
            extend = i < nd + num_extends
            computed[i] = rng.integers(1, prompt[i]) if extend and prompt[i] > 2 else 0
            left = prompt[i] - computed[i]
            scheduled[i] = rng.integers(2 if computed[i] else 1, left + 1) if left >= 2 else 1
            if computed[i] and scheduled[i] == 1:  # Rule 1 would make it a decode: keep it a fresh prompt
                computed[i] = 0
        order = np.concatenate([np.arange(nd), nd + np.argsort(computed[nd:] == 0, kind="stable")])
        computed, scheduled, prompt = computed[order], scheduled[order], prompt[order]
        if scheduled.sum() <= b.T:
            return computed, scheduled, prompt


@pytest.mark.parametrize("R,T,P,bs,cs", [(4, 16, 4, 4, 8), (16, 64, 4, 4, 8), (16, 64, 16, 16, 4), (64, 256, 4, 8, 16)])
def test_matches_the_builders_on_random_mixed_batches(R, T, P, bs, cs):
    rng = np.random.default_rng(R * 100 + P + bs)
    b = _Bucket(R, T, P, bs=bs, cs=cs)
    decodes = set()
    for _ in range(40):
        computed, scheduled, prompt = _random_batch(rng, b)
        block_table = rng.integers(0, b.num_blocks, (b.table_rows, b.columns)).astype(np.int32)
        state_table = rng.integers(1, b.num_slots, (b.table_rows, 1)).astype(np.int32)
        rows = rng.permutation(np.arange(1, b.table_rows))[: len(computed)]
        decodes.add(b.check(computed, scheduled, prompt, rows, block_table, state_table) == len(computed))
    assert decodes == {True, False}  # pure-decode batches in a mixed bucket were covered, and mixed ones


def test_edges_match_the_builders():
    b = _Bucket(8, 32, 4, bs=4, cs=4)
    bt = np.arange(9 * b.columns, dtype=np.int32).reshape(9, b.columns) % b.num_blocks
    st = np.arange(1, 10, dtype=np.int32).reshape(9, 1)
    rows = np.arange(1, 9)
    cases = {
        "only prompt chunks": ([0, 0], [5, 3], [5, 9]),
        "one-token fresh prompts lead the common decodes": ([7, 0, 0], [1, 1, 6], [3, 1, 6]),
        "a chunk ending on a chunk boundary, one crossing two": ([9, 4, 3], [1, 4, 10], [2, 20, 30]),
        "a prompt chunk that is the whole bucket": ([0], [32], [40]),
    }
    for why, (computed, scheduled, prompt) in cases.items():
        n = len(computed)
        b.check(computed, scheduled, prompt, rows[:n], bt, st), why


def test_refuses_what_it_does_not_take_and_what_the_builders_reject():
    b = _Bucket(4, 16, 2, bs=4, cs=4, num_blocks=10, num_slots=5)
    bt = np.full((5, b.columns), 3, np.int32)
    st = np.full((5, 1), 2, np.int32)
    rows = np.array([1, 2, 3], np.int32)
    ok = ([9, 2, 0], [1, 3, 4], [5, 8, 6])
    b.check(*ok, rows, bt, st)
    cases = {
        "Rule 1: a one-token chunk with prior state": (([9, 2, 0], [1, 1, 4], [5, 8, 6]), bt, st),
        "a decode after a prompt chunk": (([2, 9, 0], [3, 1, 4], [8, 5, 6]), bt, st),
        "a long extend after a fresh prompt": (([9, 0, 2], [1, 4, 3], [5, 6, 8]), bt, st),
        "more prompt chunks than the bucket's": (([0, 2, 0], [2, 3, 4], [5, 8, 6]), bt, st),
        "more tokens than the bucket's": (([9, 2, 0], [1, 3, 13], [5, 8, 20]), bt, st),
        "past max_model_len": (([b.mml, 2, 0], [1, 3, 4], [5, 8, 6]), bt, st),
        "no prompt token": (([9, 2, 0], [1, 3, 4], [0, 8, 6]), bt, st),
        "no scheduled token": (([9, 2, 0], [1, 0, 4], [5, 8, 6]), bt, st),
        "a KV block outside the pool": (ok, np.full((5, b.columns), 10, np.int32), st),
        "a negative KV block": (ok, np.full((5, b.columns), -1, np.int32), st),
        "the null state slot": (ok, bt, np.zeros((5, 1), np.int32)),
        "a state slot outside the pool": (ok, bt, np.full((5, 1), 5, np.int32)),
    }
    for why, (counts, block_table, state_table) in cases.items():
        args = [np.asarray(a, np.int32) for a in (*counts, rows)]
        assert b.writer.write_mixed(*args, block_table, state_table) is None, why
    # The builders raise on the values the writer refused for their validity (not for its shape), naming them.
    for why in ("past max_model_len", "a KV block outside the pool", "the null state slot", "no prompt token"):
        counts, block_table, state_table = cases[why]
        with pytest.raises((MetadataError, SlotError)):
            b.build(*[np.asarray(a, np.int32) for a in (*counts, rows)], block_table, state_table)
