"""``DecodeStepWriter`` writes exactly the buffer the metadata builders pack, for every pure-decode batch it takes,
and refuses (None) every batch whose values the builders would reject, so that their errors still name it."""

import numpy as np
import pytest

from jaxmamba.metadata import build_common_metadata, build_mamba_metadata, pack
from jaxmamba.metadata.decode_step import DecodeStepWriter
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS

SEPARATE = ("block_table", *DEVICE_SLOT_FIELDS)


def _builders(computed, prompt, rows, block_table, state_table, *, R, T, P, bs, mml, num_blocks, num_slots, cs,
              warmup=False):
    n = len(computed)
    common = build_common_metadata(
        num_reqs=n, num_computed_tokens=computed, num_scheduled_tokens=np.ones(n, np.int32),
        num_prompt_tokens=prompt, block_table=block_table, block_table_rows=rows, block_size=bs,
        num_reqs_padded=R, num_tokens_padded=T, max_model_len=mml, num_blocks=num_blocks, warmup=warmup)
    mamba = build_mamba_metadata(common, state_indices=state_table, cache_mode="none", block_size=bs,
                                 num_speculative_blocks=0, chunk_size=cs, num_slots=num_slots,
                                 num_prefills_padded=P, state_indices_rows=rows)
    return pack(common, mamba, separate=SEPARATE), int(mamba.num_decodes)


def _writer(layout, *, R, T, P, bs, mml, num_blocks, num_slots, cs, columns):
    return DecodeStepWriter.for_bucket(
        layout, num_reqs_padded=R, num_tokens_padded=T, num_prefills_padded=P, separate=SEPARATE, block_size=bs,
        max_model_len=mml, num_blocks=num_blocks, num_slots=num_slots, chunk_size=cs, block_table_columns=columns,
        cache_mode="none", num_spec=0)


@pytest.mark.parametrize("R,T,P,bs,mml,cs", [(4, 4, 1, 16, 64, 8), (16, 32, 2, 4, 96, 16), (64, 64, 1, 32, 256, 64)])
def test_matches_the_builders_on_random_decode_batches(R, T, P, bs, mml, cs):
    rng = np.random.default_rng(R * 1000 + bs)
    columns, num_blocks, num_slots, table_rows = -(-mml // bs), 500, 300, R + 1
    layout = _builders(np.array([1], np.int32), np.array([1], np.int32), np.array([1], np.int32),
                       np.ones((table_rows, columns), np.int32), np.ones((table_rows, 1), np.int32), R=R, T=T, P=P,
                       bs=bs, mml=mml, num_blocks=num_blocks, num_slots=num_slots, cs=cs, warmup=True)[0].layout
    writer = _writer(layout, R=R, T=T, P=P, bs=bs, mml=mml, num_blocks=num_blocks, num_slots=num_slots, cs=cs,
                     columns=columns)
    assert writer is not None
    for _ in range(25):
        n = int(rng.integers(1, R + 1))
        block_table = rng.integers(0, num_blocks, (table_rows, columns)).astype(np.int32)
        state_table = rng.integers(1, num_slots, (table_rows, 1)).astype(np.int32)
        rows = rng.permutation(np.arange(1, table_rows))[:n].astype(np.int32)
        computed = rng.integers(1, mml, n).astype(np.int32)
        prompt = np.minimum(computed, rng.integers(1, mml, n)).astype(np.int32)  # every row past its prompt
        expected, num_decodes = _builders(computed, prompt, rows, block_table, state_table, R=R, T=T, P=P, bs=bs,
                                          mml=mml, num_blocks=num_blocks, num_slots=num_slots, cs=cs)
        got = writer.write(computed, prompt, rows, block_table, state_table)
        assert num_decodes == n
        np.testing.assert_array_equal(got, expected.buffer)
        assert got.dtype == expected.buffer.dtype == np.int32


def test_refuses_what_the_builders_reject_and_other_modes():
    R, T, P, bs, mml, cs, columns = 4, 4, 1, 16, 64, 8, 4
    block_table = np.full((5, columns), 3, np.int32)
    state_table = np.full((5, 1), 2, np.int32)
    layout = _builders(np.array([1], np.int32), np.array([1], np.int32), np.array([1], np.int32), block_table,
                       state_table, R=R, T=T, P=P, bs=bs, mml=mml, num_blocks=10, num_slots=5, cs=cs)[0].layout
    writer = _writer(layout, R=R, T=T, P=P, bs=bs, mml=mml, num_blocks=10, num_slots=5, cs=cs, columns=columns)
    rows = np.array([1, 2], np.int32)
    ok = dict(computed=np.array([5, 9], np.int32), prompt=np.array([5, 3], np.int32))
    assert writer.write(ok["computed"], ok["prompt"], rows, block_table, state_table) is not None
    cases = {
        "past max_model_len": (np.array([5, mml], np.int32), ok["prompt"], block_table, state_table),
        "still prefilling": (ok["computed"], np.array([6, 3], np.int32), block_table, state_table),
        "a KV block outside the pool": (ok["computed"], ok["prompt"], np.full((5, columns), 10, np.int32), state_table),
        "a negative KV block": (ok["computed"], ok["prompt"], np.full((5, columns), -1, np.int32), state_table),
        "the null state slot": (ok["computed"], ok["prompt"], block_table, np.zeros((5, 1), np.int32)),
        "a state slot outside the pool": (ok["computed"], ok["prompt"], block_table, np.full((5, 1), 5, np.int32)),
        "nothing computed": (np.array([0, 9], np.int32), np.array([0, 3], np.int32), block_table, state_table),
    }
    for why, (computed, prompt, bt, st) in cases.items():
        assert writer.write(computed, prompt, rows, bt, st) is None, why
    assert writer.write(np.zeros(0, np.int32), np.zeros(0, np.int32), rows[:0], block_table, state_table) is None
    for mode, spec in (("align", 0), ("none", 1)):
        assert DecodeStepWriter.for_bucket(
            layout, num_reqs_padded=R, num_tokens_padded=T, num_prefills_padded=P, separate=SEPARATE, block_size=bs,
            max_model_len=mml, num_blocks=10, num_slots=5, chunk_size=cs, block_table_columns=columns,
            cache_mode=mode, num_spec=spec) is None
    # A layout of another bucket (more rows) is not this writer's: no writer rather than a wrong buffer.
    assert _writer(layout, R=8, T=8, P=P, bs=bs, mml=mml, num_blocks=10, num_slots=5, cs=cs, columns=columns) is None
