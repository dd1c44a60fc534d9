"""Metadata builders: seed regression tests, examples, bad inputs, jit behaviour.

Property tests over random batches live in ``test_metadata_properties.py``;
comparisons with vLLM's own functions in ``test_metadata_vllm.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmamba.errors import MetadataError, SlotError
from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.metadata.mamba_builder import chunk_boundaries
from jaxmamba.metadata import (
    CommonAttentionMetadata,
    MambaMetadata,
    build_common_metadata,
    build_mamba_metadata,
    check_batch_order,
    compute_chunk_metadata,
    mamba_block_table_columns,
    mamba_is_prefilling,
    num_chunks_for_bucket,
    pack,
    pad_to_bucket,
    reorder_batch,
    split_decodes_and_prefills,
    unpack,
)

BS = 4  # attention and Mamba block size in these examples
MML = 64  # max_model_len


def attn_table(rows: int, cols: int = MML // BS) -> np.ndarray:
    """Distinct KV block ids per row (1-based: block 0 is the null block)."""
    return (np.arange(rows * cols).reshape(rows, cols) + 1).astype(np.int32)


def state_table(rows: int, cache_mode: str, k: int, mml: int = MML, bs: int = BS) -> np.ndarray:
    """Distinct real state slots for every column of a correctly sized Mamba block table."""
    cols = mamba_block_table_columns(cache_mode, mml, bs, k)
    return (np.arange(rows * cols).reshape(rows, cols) + 1).astype(np.int32)


def common_for(computed, scheduled, prompt, *, R=None, T=None, threshold=1, **kw):
    n = kw.pop("num_reqs", len(computed))
    rows = len(computed)
    return build_common_metadata(
        num_reqs=n,
        num_computed_tokens=np.asarray(computed),
        num_scheduled_tokens=np.asarray(scheduled),
        num_prompt_tokens=np.asarray(prompt),
        block_table=kw.pop("block_table", attn_table(rows)),
        block_size=BS,
        num_reqs_padded=R or max(n, 1),
        num_tokens_padded=T if T is not None else int(np.sum(np.asarray(scheduled)[:n])),
        max_model_len=kw.pop("max_model_len", MML),
        decode_threshold=threshold,
        **kw,
    )


def mamba_for(common, *, cache_mode="none", k=0, table=None, chunk_size=2, rows=None, **kw):
    rows = rows if rows is not None else int(common.num_reqs)
    if table is None:
        table = state_table(rows, cache_mode, k, common.max_model_len)
    return build_mamba_metadata(
        common,
        state_indices=table,
        cache_mode=cache_mode,
        block_size=BS,
        num_speculative_blocks=k,
        chunk_size=chunk_size,
        num_slots=int(np.max(table)) + 1,
        **kw,
    )


def leaves_equal(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


# ------------------------------------------- docs/architecture.md, Rule 1 (test_seed000_*)


def test_seed000_single_token_extend_with_prior_state_is_decode():
    # Row 2 is still in its prompt (computed 4 < prompt 5) but has prior state
    # and schedules one token: the P/D "h(N-1) -> N" row. It must be a decode,
    # so a uniform one-token batch runs entirely on the decode path.
    assert list(mamba_is_prefilling([False, False, True], [1, 1, 1], [8, 9, 5])) == [False, False, False]
    common = common_for([7, 8, 4], [1, 1, 1], [3, 3, 5])
    assert bool(common.is_prefilling[2])
    for mode in ("none", "align", "all"):
        md = mamba_for(common, cache_mode=mode)
        assert (int(md.num_decodes), int(md.num_prefills)) == (3, 0)
        assert int(md.num_decode_tokens) == 3 and int(md.num_prefill_tokens) == 0
        table = state_table(3, mode, 0)
        col = 0 if mode == "none" else (4 + BS - 1) // BS - 1  # block of the last computed token
        assert int(md.state_indices_decode[2, 0]) == table[2, col]
        assert int(md.query_start_loc_prefill[-1]) == 0


def test_seed000_first_token_prefill_without_prior_state_stays_prefill():
    # vLLM's companion case: seq_len == 1 means no prior state: keep it a prefill.
    assert list(mamba_is_prefilling([False, False, True], [1, 1, 1], [8, 9, 1])) == [False, False, True]
    common = common_for([7, 8, 0], [1, 1, 1], [3, 3, 5])
    md = mamba_for(common)
    assert (int(md.num_decodes), int(md.num_prefills)) == (2, 1)
    assert not bool(md.has_initial_state[0])


def test_seed000_draft_padded_prompt_tail_is_spec_decode():
    # A one-token prompt tail padded with two placeholder drafts runs as a spec decode.
    assert list(mamba_is_prefilling([True, True], [3, 3], [10, 3], num_draft_tokens=[2, 2])) == [False, True]
    assert list(mamba_is_prefilling([True], [3], [10], num_draft_tokens=[-1])) == [True]


def test_seed000_reclassified_row_reads_column_zero_despite_stale_accept_count():
    # With spec decode on, the reclassified row's state was written by a prefill,
    # into the first slot of its window: a stale accepted count must not move the read.
    common = common_for([7, 4], [3, 1], [3, 5], threshold=3)
    md = mamba_for(common, k=2, num_accepted_tokens=np.array([2, 3, 3]))
    assert int(md.num_decodes) == 2
    assert list(np.asarray(md.num_accepted_tokens[:2])) == [2, 1]


# ------------------------------------------- docs/architecture.md, Rule 2 (test_seed001_*)


def test_seed001_block_table_columns_include_speculative_blocks():
    assert mamba_block_table_columns("none", 100, 16, 0) == 1
    assert mamba_block_table_columns("none", 100, 16, 3) == 4
    assert mamba_block_table_columns("align", 100, 16, 0) == 7
    assert mamba_block_table_columns("align", 100, 16, 3) == 10
    assert mamba_block_table_columns("all", 96, 16, 2) == 8
    # A table sized without the speculative blocks (the seed-001 crash) is rejected clearly.
    common = common_for([60], [3], [10], threshold=3)
    short = state_table(1, "all", 0)
    with pytest.raises(MetadataError, match=r"state_indices has 16 columns.*num_speculative_blocks = 18"):
        mamba_for(common, cache_mode="all", k=2, table=short)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_seed001_decode_at_last_block_gathers_all_spec_slots(mode):
    # A spec decode ending at max_model_len: its window is the last block plus
    # the num_spec speculative blocks, which exist only because of the +num_spec columns.
    k = 2
    common = common_for([MML - 3], [3], [10], threshold=3)
    table = state_table(1, mode, k)
    md = mamba_for(common, cache_mode=mode, k=k, table=table, num_accepted_tokens=np.array([3]))
    last = MML // BS - 1
    assert list(np.asarray(md.state_indices_decode_dst[0])) == list(table[0, last : last + 3])
    assert int(md.block_idx_last_scheduled_token[0]) == last
    assert np.asarray(md.state_indices_decode).shape == (1, 1 + k)


def test_seed001_mode_all_spec_reads_from_previous_step_block():
    k = 2
    # Row 0: last step scheduled 3 tokens ending in block 3, accepted 1: the
    # computed tokens end in block 2, but the states were written from block 3.
    common = common_for([10, 9], [3, 3], [4, 4], threshold=3)
    table = state_table(2, "all", k)
    md = mamba_for(
        common, cache_mode="all", k=k, table=table, num_accepted_tokens=np.array([1, 2]),
        prev_step_last_block=np.array([3, -1]),
    )
    assert list(np.asarray(md.state_indices_decode[0])) == list(table[0, 3:6])
    # -1 falls back to the block of the last computed token (9 tokens -> block 2).
    assert list(np.asarray(md.state_indices_decode[1])) == list(table[1, 2:5])
    assert list(np.asarray(md.block_idx_last_scheduled_token_prev_step[:2])) == [3, 2]
    # Mode align reads from the last computed block and refuses the prev-step input.
    md_align = mamba_for(common, cache_mode="align", k=k, num_accepted_tokens=np.array([1, 2]))
    assert list(np.asarray(md_align.state_indices_decode[0])) == list(state_table(2, "align", k)[0, 2:5])
    with pytest.raises(MetadataError, match="prev_step_last_block"):
        mamba_for(common, cache_mode="align", k=k, prev_step_last_block=np.array([3, -1]))


def test_seed001_decode_buffers_sized_by_requests_not_tokens():
    # A spec-decode bucket with 4 request rows and 16 token rows: every
    # per-request buffer has 4 rows (vLLM's bug sized one by decode tokens).
    common = common_for([8, 9, 10], [3, 3, 2], [4, 4, 4], R=4, T=16, threshold=3)
    md = mamba_for(common, cache_mode="all", k=2, num_accepted_tokens=np.array([1, 2, 3]))
    for name in (
        "state_indices_decode",
        "state_indices_decode_dst",
        "num_accepted_tokens",
        "block_idx_last_scheduled_token",
        "block_idx_last_computed_token",
        "block_idx_last_scheduled_token_prev_step",
    ):
        assert np.asarray(getattr(md, name)).shape[0] == 4, name


# ------------------------------------------- docs/architecture.md, Rule 3 (test_seed002_*)


def test_seed002_padded_rows_never_prefilling_and_point_at_no_slot():
    # Persistent buffers: rows 3 and 4 are stale (left by condense); their
    # computed < prompt says "prefilling" and their slots are live elsewhere.
    computed = np.array([50, 60, 20, 10, 20])
    scheduled = np.array([1, 1, 6, 7, 9])
    prompt = np.array([50, 60, 100, 100, 200])
    common = common_for(computed, scheduled, prompt, num_reqs=3, R=5, T=16, max_model_len=256,
                        block_table=attn_table(5, 64))
    assert list(np.asarray(common.is_prefilling)) == [False, False, True, False, False]
    assert list(np.asarray(np.diff(common.query_start_loc))) == [1, 1, 6, 0, 0]
    assert list(np.asarray(common.seq_lens)) == [51, 61, 26, 0, 0]
    assert not np.asarray(common.block_table[3:]).any()
    for mode in ("none", "all"):
        table = state_table(5, mode, 0, 256)
        md = mamba_for(common, cache_mode=mode, table=table)
        assert (int(md.num_decodes), int(md.num_prefills)) == (2, 1)
        assert (np.asarray(md.state_indices_decode[2:]) == PAD_SLOT_ID).all()
        assert (np.asarray(md.state_indices_prefill[1:]) == PAD_SLOT_ID).all()
        assert not np.asarray(md.has_initial_state[1:]).any()
        live = set(table[3:].ravel().tolist())
        used = set(np.asarray(md.state_indices_decode).ravel().tolist()) | set(
            np.asarray(md.state_indices_prefill).ravel().tolist()
        )
        assert not (live & used)
    # Stale rows make no difference at all.
    clean = common_for(np.r_[computed[:3], 0, 0], np.r_[scheduled[:3], 0, 0], np.r_[prompt[:3], 1, 1], num_reqs=3,
                       R=5, T=16, max_model_len=256, block_table=np.r_[attn_table(5, 64)[:3], np.zeros((2, 64), int)])
    assert leaves_equal(common, clean)


# ------------------------------------------- docs/architecture.md, Rule 4 (test_seed004_*)


def test_seed004_max_seq_len_is_batch_max_not_max_model_len():
    computed = np.array([4, 16, 900])  # row 2 is stale, longer than anything real
    common = common_for(computed, [1, 1, 1], [1, 1, 1], num_reqs=2, R=4, T=4, max_model_len=1024,
                        block_table=attn_table(3, 256))
    assert int(common.max_seq_len) == 17
    warm = common_for(computed, [1, 1, 1], [1, 1, 1], num_reqs=2, R=4, T=4, max_model_len=1024,
                      block_table=attn_table(3, 256), warmup=True)
    assert int(warm.max_seq_len) == 1024
    assert int(common_for([], [], [], num_reqs=0, R=2, T=2).max_seq_len) == 0


# --------------------------------------------------------------------------- examples


def test_split_decodes_and_prefills_follows_vllm():
    assert split_decodes_and_prefills([1, 1, 1]) == (3, 0, 3, 0)
    assert split_decodes_and_prefills([1, 1, 5, 3]) == (2, 2, 2, 8)
    assert split_decodes_and_prefills([4, 1]) == (0, 2, 0, 5)  # first row long: no decodes
    assert split_decodes_and_prefills([2, 3, 7], decode_threshold=3) == (2, 1, 5, 7)
    # Short extends: decodes for attention, prefills for Mamba.
    assert split_decodes_and_prefills([1, 1, 1], [False, True, False]) == (3, 0, 3, 0)
    assert split_decodes_and_prefills([1, 1, 1], [False, True, False], treat_short_extends_as_decodes=False) == (
        1, 2, 1, 2,
    )
    assert split_decodes_and_prefills([]) == (0, 0, 0, 0)
    with pytest.raises(MetadataError, match="is_prefilling"):
        split_decodes_and_prefills([1, 2], treat_short_extends_as_decodes=False)


def test_reorder_batch_orders_regions_and_puts_reclassified_extends_first():
    # rows: prefill, decode, long extend, short extend (q=2, spec), short extend with state (q=1), decode
    q = np.array([5, 1, 6, 2, 1, 3])
    seq = np.array([5, 9, 16, 12, 7, 20])
    prefilling = np.array([True, False, True, True, True, False])
    perm = reorder_batch(q, prefilling, seq, decode_threshold=3)
    assert list(perm) == [1, 5, 4, 3, 2, 0]
    check_batch_order(q[perm], (seq - q)[perm], prefilling[perm], decode_threshold=3)
    with pytest.raises(MetadataError, match="row 1 is a decode after row 0, a prefill"):
        check_batch_order(q, seq - q, prefilling, decode_threshold=3)


def test_chunks_restart_at_chunk_size_multiples_in_absolute_position():
    # Row 0 restarts at position 3 (prefix hit / previous chunk): its first chunk
    # finishes [3, 4); row 1 starts at 0.
    cu, seq_idx, last = compute_chunk_metadata([3, 0], [7, 5], chunk_size=4)
    assert list(cu) == [0, 1, 5, 7, 11, 12]
    assert list(seq_idx) == [0, 0, 0, 1, 1]
    assert list(last) == [2, 4]


def test_chunks_match_a_token_by_token_walk():
    """Every SSD chunk ends where a row's absolute position reaches a multiple of the chunk size or the row ends,
    counted token by token (an oracle independent of the rule's arithmetic), for random batches and chunk sizes."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, chunk_size = int(rng.integers(0, 12)), int(rng.choice([1, 2, 3, 8, 64]))
        computed, query_lens = rng.integers(0, 200, rows).tolist(), rng.integers(1, 150, rows).tolist()
        cu, seq_idx, last, packed = [0], [], [], 0
        for j, (c, q) in enumerate(zip(computed, query_lens, strict=True)):
            for offset in range(q):
                position = c + offset
                if (position + 1) % chunk_size == 0 or offset == q - 1:
                    cu.append(packed + offset + 1)
                    seq_idx.append(j)
            last.append(len(seq_idx) - 1)
            packed += q
        assert chunk_boundaries(computed, query_lens, chunk_size) == (cu, seq_idx, last)
        got = compute_chunk_metadata(computed, query_lens, chunk_size)
        assert [a.tolist() for a in got] == [cu, seq_idx, last] and all(a.dtype == np.int32 for a in got)


def test_num_chunks_for_bucket_is_an_upper_bound():
    # Every 2-token row straddles a chunk boundary: 2 chunks per row.
    cu, _, _ = compute_chunk_metadata([3, 7], [2, 2], chunk_size=4)
    assert cu.size - 1 == 4
    assert num_chunks_for_bucket(4, 2, 4) - 1 >= 4
    assert num_chunks_for_bucket(4, 2, 4) == 5


def test_mamba_prefill_slots_block_indices_and_checkpoints():
    # One decode and one prefix-cached restart at position 8 (two blocks cached),
    # scheduling 10 tokens: chunks of 2, blocks of 4.
    common = common_for([12, 8], [1, 10], [5, 30], T=12)
    table = state_table(2, "all", 0)
    md = mamba_for(common, cache_mode="all", table=table)
    assert (int(md.num_decodes), int(md.num_prefills)) == (1, 1)
    assert bool(md.has_initial_state[0])
    assert int(md.state_indices_prefill_initial[0]) == table[1, 1]  # block holding tokens 4..7
    assert int(md.state_indices_prefill[0]) == table[1, 4]  # block of token 17
    assert list(np.asarray(md.block_idx_first_scheduled_token[:2])) == [3, 2]
    assert list(np.asarray(md.block_idx_last_scheduled_token[:2])) == [3, 4]
    nc = int(md.last_chunk_indices[0]) + 1
    assert list(np.asarray(md.cu_chunk_seqlens[: nc + 1])) == [0, 2, 4, 6, 8, 10]
    # Chunks ending at positions 12 and 16 end blocks 2 and 3 (the last chunk ends at 18).
    assert list(np.asarray(md.state_indices_chunk_checkpoint[:nc])) == [-1, table[1, 2], -1, table[1, 3], -1]
    none = mamba_for(common, cache_mode="none")
    assert int(none.state_indices_prefill[0]) == int(none.state_indices_prefill_initial[0]) == 2
    assert (np.asarray(none.state_indices_chunk_checkpoint) == PAD_SLOT_ID).all()


def test_slot_mapping_and_positions():
    common = common_for([5, 0], [1, 3], [2, 3], block_table=np.array([[7, 9] + [0] * 14, [3] + [0] * 15]), T=6)
    assert list(np.asarray(common.positions)) == [5, 0, 1, 2, 0, 0]
    assert list(np.asarray(common.slot_mapping)) == [9 * BS + 1, 3 * BS, 3 * BS + 1, 3 * BS + 2, -1, -1]


def test_pad_to_bucket_keeps_real_rows_and_matches_direct_build():
    args = ([12, 8], [1, 10], [5, 30])
    small = common_for(*args, R=2, T=11)
    big = common_for(*args, R=8, T=32)
    assert leaves_equal(pad_to_bucket(small, (8, 32)), big)
    md_small, md_big = mamba_for(small, cache_mode="all"), mamba_for(big, cache_mode="all")
    padded = pad_to_bucket(md_small, (8, 32))
    assert padded.num_chunks_padded == num_chunks_for_bucket(32, 8, 2)
    assert leaves_equal(padded, md_big)
    with pytest.raises(MetadataError, match="bucket too small"):
        pad_to_bucket(big, (4, 32))
    with pytest.raises(MetadataError, match="bucket too small"):
        pad_to_bucket(md_big, (8, 16))


def test_prefill_rows_are_a_bucket_dimension():
    """Prefill-indexed arrays and the SSD chunk count follow ``num_prefills_padded``, not the request rows:
    a mostly-decode step does not carry R rows of SSD state. Real content is the same at every P."""
    # Rows 0-5 decode, rows 6-7 prefill (one restarting after 8 computed tokens).
    computed, scheduled, prompt = [9, 7, 8, 5, 6, 4, 8, 0], [1] * 6 + [10, 6], [3] * 6 + [30, 6]
    common = common_for(computed, scheduled, prompt, R=8, T=32)
    narrow = mamba_for(common, cache_mode="all", num_prefills_padded=2)
    wide = mamba_for(common, cache_mode="all")  # P defaults to R
    assert (narrow.num_prefills_padded, wide.num_prefills_padded) == (2, 8)
    assert narrow.num_chunks_padded == num_chunks_for_bucket(32, 2, 2) < wide.num_chunks_padded
    assert np.asarray(narrow.state_indices_prefill).shape == (2,)
    assert np.asarray(narrow.query_start_loc_prefill).shape == (3,)
    assert np.asarray(narrow.last_chunk_indices).shape == (2,)
    assert (int(narrow.num_decodes), int(narrow.num_prefills)) == (6, 2)
    for name in ("state_indices_decode", "state_indices_decode_dst", "num_accepted_tokens", "query_start_loc_decode",
                 "block_idx_last_scheduled_token"):
        np.testing.assert_array_equal(np.asarray(getattr(narrow, name)), np.asarray(getattr(wide, name)), name)
    for name in ("state_indices_prefill", "state_indices_prefill_initial", "has_initial_state"):
        np.testing.assert_array_equal(np.asarray(getattr(narrow, name)), np.asarray(getattr(wide, name))[:2], name)
    nc = int(narrow.last_chunk_indices[-1]) + 1
    for name in ("cu_chunk_seqlens", "seq_idx", "state_indices_chunk_checkpoint"):
        np.testing.assert_array_equal(np.asarray(getattr(narrow, name))[:nc], np.asarray(getattr(wide, name))[:nc])
    # Moving to a bucket with more prefill rows equals building there.
    assert leaves_equal(pad_to_bucket(narrow, (8, 32, 8)), wide)
    assert leaves_equal(pad_to_bucket(narrow, (8, 32, 4)), mamba_for(common, cache_mode="all", num_prefills_padded=4))
    with pytest.raises(MetadataError, match="2 prefill rows > num_prefills_padded=1"):
        mamba_for(common, cache_mode="all", num_prefills_padded=1)
    with pytest.raises(MetadataError, match="num_prefills_padded=9 exceeds num_reqs_padded=8"):
        mamba_for(common, cache_mode="all", num_prefills_padded=9)
    with pytest.raises(MetadataError, match="bucket too small"):
        pad_to_bucket(wide, (8, 32, 2))


# --------------------------------------------------------------------------- bad inputs


def _good_common_kwargs(**over):
    kw = dict(
        num_reqs=2,
        num_computed_tokens=np.array([4, 0, 0]),
        num_scheduled_tokens=np.array([1, 5, 0]),
        num_prompt_tokens=np.array([3, 5, 1]),
        block_table=attn_table(3),
        block_size=BS,
        num_reqs_padded=4,
        num_tokens_padded=8,
        max_model_len=MML,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, error, field",
    [
        (dict(num_computed_tokens=np.array([-1, 0, 0])), MetadataError, "num_computed_tokens"),
        (dict(num_scheduled_tokens=np.array([1, -5, 0])), MetadataError, "num_scheduled_tokens"),
        (dict(num_scheduled_tokens=np.array([0, 5, 0])), MetadataError, "num_scheduled_tokens"),
        (dict(num_prompt_tokens=np.array([-3, 5, 1])), MetadataError, "num_prompt_tokens"),
        (dict(num_reqs=4), MetadataError, "num_reqs=4 exceeds"),
        (dict(num_reqs=-1), MetadataError, "num_reqs"),
        (dict(block_table=attn_table(1)), MetadataError, "block_table"),
        (dict(block_table=attn_table(3, 1)), MetadataError, "block_table has 1 columns"),
        (dict(block_table=-attn_table(3)), SlotError, "block_table"),
        (dict(num_blocks=10), SlotError, r"block_table\[1, 0\]=17"),
        (dict(num_reqs_padded=1), MetadataError, "bucket too small.*num_reqs_padded"),
        (dict(num_tokens_padded=4), MetadataError, "bucket too small.*num_tokens_padded"),
        (dict(max_model_len=4), MetadataError, "max_model_len"),
        (dict(block_size=0), MetadataError, "block_size"),
        (dict(num_computed_tokens=np.array([0, 4, 0])), MetadataError, "batch order"),
    ],
)
def test_bad_common_inputs_raise_value_errors_naming_the_field(over, error, field):
    with pytest.raises(error, match=field) as info:
        build_common_metadata(**_good_common_kwargs(**over))
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "over, error, field",
    [
        (dict(state_indices=state_table(1, "align", 0)), MetadataError, "num_reqs=2 exceeds the 1 rows of state_indices"),
        (dict(state_indices=state_table(3, "align", 0), num_slots=5), SlotError, r"state_indices\[row 1, column 1\]=18"),
        (dict(state_indices=np.full((3, 16), -7)), SlotError, "state_indices"),
        (dict(state_indices=np.zeros((3, 16), int)), SlotError, "decode read slot"),
        (dict(cache_mode="some"), MetadataError, "cache_mode"),
        (dict(chunk_size=3), MetadataError, "block_size=4 must be a multiple of chunk_size=3"),
        (dict(num_accepted_tokens=np.array([2, 1])), MetadataError, "num_accepted_tokens"),
        (dict(num_speculative_blocks=-1), MetadataError, "num_speculative_blocks"),
    ],
)
def test_bad_mamba_inputs_raise_value_errors_naming_the_field(over, error, field):
    common = build_common_metadata(**_good_common_kwargs())
    kw = dict(state_indices=state_table(3, "align", 0), cache_mode="align", block_size=BS, num_speculative_blocks=0,
              chunk_size=2, num_slots=1000)
    kw.update(over)
    with pytest.raises(error, match=field) as info:
        build_mamba_metadata(common, **kw)
    assert isinstance(info.value, ValueError)


def test_bad_spec_inputs_raise():
    common = common_for([8, 9], [3, 3], [4, 4], threshold=3)
    with pytest.raises(MetadataError, match=r"num_accepted_tokens\[1\]=4 is outside \[1, 3\]"):
        mamba_for(common, cache_mode="all", k=2, num_accepted_tokens=np.array([1, 4]))
    with pytest.raises(MetadataError, match=r"prev_step_last_block\[0\]=16 is outside \[-1, 15\]"):
        mamba_for(common, cache_mode="all", k=2, num_accepted_tokens=np.array([1, 1]),
                  prev_step_last_block=np.array([16, 0]))


# --------------------------------------------------------------------------- jax side


def _bucket_batch(variant: int):
    """Different batches (counts, lengths, kinds) that all fit bucket (R=4, T=16)."""
    batches = [
        ([12, 8], [1, 10], [5, 30]),
        ([5, 6, 7, 0], [1, 1, 1, 6], [2, 2, 2, 6]),
        ([0], [16], [20]),
        ([3, 9, 2], [1, 1, 1], [3, 4, 9]),
    ]
    computed, scheduled, prompt = batches[variant]
    common = common_for(computed, scheduled, prompt, R=4, T=16)
    return common, mamba_for(common, cache_mode="all")


def test_metadata_pytrees_do_not_retrace_within_a_bucket():
    traces = []

    def step(common: CommonAttentionMetadata, mamba: MambaMetadata):
        traces.append(1)
        q = jnp.diff(common.query_start_loc)
        real = jnp.arange(common.num_reqs_padded) < common.num_reqs
        return (jnp.sum(jnp.where(real, q, 0)) + mamba.num_decodes * 1000 + common.max_seq_len * 100000,
                mamba.cu_chunk_seqlens[-1])

    jitted = jax.jit(step)
    for variant in range(4):
        common, mamba = _bucket_batch(variant)
        total, prefill_tokens = jitted(jax.device_put(common), jax.device_put(mamba))
        expect = int(common.num_actual_tokens) + int(mamba.num_decodes) * 1000 + int(common.max_seq_len) * 100000
        assert int(total) == expect
        assert int(prefill_tokens) == int(mamba.num_prefill_tokens)
    assert len(traces) == 1
    # A different bucket is a different program.
    common = pad_to_bucket(_bucket_batch(0)[0], (8, 16))
    jitted(common, pad_to_bucket(_bucket_batch(0)[1], (8, 16)))
    assert len(traces) == 2


def test_pack_is_one_buffer_and_unpacks_inside_jit_without_retrace():
    traces = []

    def step(buf, layout):
        traces.append(1)
        common, mamba = unpack(buf, layout)
        return common.num_actual_tokens, mamba.state_indices_prefill, common.is_prefilling

    jitted = jax.jit(step, static_argnames="layout")
    layouts = set()
    for variant in range(4):
        common, mamba = _bucket_batch(variant)
        packed = pack(common, mamba)
        assert packed.buffer.dtype == np.int32 and packed.buffer.ndim == 1
        layouts.add(packed.layout)
        # Round trip on the host is exact, dtypes included.
        c2, m2 = unpack(packed.buffer, packed.layout)
        assert leaves_equal(c2, common) and leaves_equal(m2, mamba)
        tokens, prefill_slots, prefilling = jitted(jax.device_put(packed.buffer), layout=packed.layout)
        assert int(tokens) == int(common.num_actual_tokens)
        assert np.array_equal(np.asarray(prefill_slots), np.asarray(mamba.state_indices_prefill))
        assert prefilling.dtype == jnp.bool_
        assert np.array_equal(np.asarray(prefilling), np.asarray(common.is_prefilling))
    assert len(layouts) == 1 and len(traces) == 1
    assert common.pack().layout.size < packed.layout.size
    with pytest.raises(MetadataError, match="unpack"):
        unpack(np.zeros(3, np.int32), packed.layout)


def test_pack_can_leave_a_leaf_out_of_the_buffer():
    """The engine ships the block table as its own step argument (read in place, never copied out of the
    buffer into a max_model_len-wide temporary): the round trip puts it back, and mistakes are named."""
    common, mamba = _bucket_batch(0)
    whole = pack(common, mamba)
    packed = pack(common, mamba, separate=("block_table",))
    table = np.asarray(common.block_table)
    assert packed.layout.size == whole.layout.size - table.size
    assert dict(packed.layout.separate) == {"block_table": table.shape}
    assert np.array_equal(packed.separate["block_table"], table)
    c2, m2 = unpack(packed.buffer, packed.layout, block_table=packed.separate["block_table"])
    assert leaves_equal(c2, common) and leaves_equal(m2, mamba)
    with pytest.raises(MetadataError, match="separate leaves are \\['block_table'\\], got \\[\\]"):
        unpack(packed.buffer, packed.layout)
    with pytest.raises(MetadataError, match="block_table has shape"):
        unpack(packed.buffer, packed.layout, block_table=table[:1])
    with pytest.raises(MetadataError, match="not data leaves"):
        pack(common, mamba, separate=("no_such_leaf",))
    with pytest.raises(MetadataError, match="more than one metadata object"):
        pack(common, mamba, separate=("num_reqs",))


# --------------------------------------------------------------------------- persistent block-table rows
def test_persistent_table_rows_build_what_the_gathered_table_does():
    """``block_table_rows``: the rows live in a persistent table (the engine's device-table mirror). Every leaf
    equals a build from the gathered rows, except ``block_table``: a zero placeholder that owns no memory
    (the step reads the persistent device table)."""
    computed, scheduled, prompt = [9, 7, 8, 0], [1, 1, 5, 6], [3, 3, 30, 6]
    persistent = np.zeros((6, MML // BS), np.int32)
    row_map = np.array([4, 1, 5, 2], np.int32)
    persistent[row_map] = attn_table(4)
    direct = common_for(computed, scheduled, prompt, R=6, T=16, block_table=persistent[row_map], num_blocks=100)
    rows = common_for(computed, scheduled, prompt, R=6, T=16, block_table=persistent, block_table_rows=row_map,
                      num_blocks=100)
    assert leaves_equal(dataclasses.replace(rows, block_table=direct.block_table), direct)
    assert rows.block_table.shape == (6, MML // BS) and rows.block_table.strides == (0, 0)
    assert not np.asarray(rows.block_table).any()
    packed = pack(rows, separate=("block_table",))
    assert packed.layout == pack(direct, separate=("block_table",)).layout
    # Bad rows and a bad block id at a token's block are still refused, naming them.
    with pytest.raises(MetadataError, match=r"block_table_rows\[3\]=6 is outside the 6 rows"):
        common_for(computed, scheduled, prompt, R=6, T=16, block_table=persistent, block_table_rows=[4, 1, 5, 6])
    persistent[5, 2] = 100  # row 2 (persistent row 5) writes positions 8..12 into its columns 2 and 3
    with pytest.raises(SlotError, match=r"block_table\[5, 2\]=100 \(row 2's block for position 8\) is outside "
                                        r"the KV block pool \[0, 100\)"):
        common_for(computed, scheduled, prompt, R=6, T=16, block_table=persistent, block_table_rows=row_map,
                   num_blocks=100)


def test_host_arrays_built_per_step_do_not_follow_max_model_len():
    """Building a step's metadata from persistent rows allocates the same host memory at a 4k and a 128k
    context (it used to copy, widen and mask every row's full-width table: ~4 x 8192 x 8 B x 3 here)."""
    import tracemalloc

    def persistent_table(mml):  # the engine's mirror: allocated once, not per step
        persistent = np.zeros((5, cdiv_int(mml, 16)), np.int32)
        persistent[1:, :4] = np.arange(1, 17).reshape(4, 4)
        return persistent

    def build(mml, persistent):
        common = build_common_metadata(
            num_reqs=4, num_computed_tokens=np.array([40, 20, 33, 0]), num_scheduled_tokens=np.array([1, 1, 1, 9]),
            num_prompt_tokens=np.array([3, 3, 3, 9]), block_table=persistent, block_table_rows=np.array([1, 2, 3, 4]),
            block_size=16, num_reqs_padded=4, num_tokens_padded=16, max_model_len=mml, num_blocks=17,
            decode_threshold=1)
        return pack(common, separate=("block_table",)), common

    def peak(mml):
        persistent = persistent_table(mml)
        build(mml, persistent)  # lays out the pack plan once
        tracemalloc.start()
        try:
            packed, common = build(mml, persistent)
            return tracemalloc.get_traced_memory()[1], packed, common
        finally:
            tracemalloc.stop()

    (short_peak, short, short_md), (long_peak, long, long_md) = peak(4096), peak(131072)
    owned = lambda a: 0 if 0 in a.strides else a.nbytes  # noqa: E731 (a broadcast placeholder owns nothing)
    assert [owned(np.asarray(x)) for x in jax.tree_util.tree_leaves(short_md)] == \
        [owned(np.asarray(x)) for x in jax.tree_util.tree_leaves(long_md)]
    assert short.buffer.shape == long.buffer.shape
    assert long_peak - short_peak < 4096, (short_peak, long_peak)


def cdiv_int(a: int, b: int) -> int:
    return -(-a // b)
