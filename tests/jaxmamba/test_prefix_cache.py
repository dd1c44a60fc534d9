"""Prefix cache manager (``jaxmamba.engine.prefix_cache``): unit, property and simulation tests.

The simulation (``Sim``) drives the manager like an engine would (continuous
batching, chunked prefill, recompute preemption, speculative decoding with
random acceptance), builds every step's metadata with the real host builders
(``build_common_metadata`` / ``build_mamba_metadata``), and executes the step
on a fake device: a KV slot holds the "prefix value" (a rolling hash of all
tokens up to and including its token), a state slot holds the prefix value of
the tokens it summarises (SSM) and the per-token history of its last writer
(conv). Every read is checked against the true prefix value, so a wrong prefix
hit, a stale state, a slot written while shared, or a wrong column shows up as
a mismatch. The conv state is assumed to be written to the destination window
(``state_indices_decode_dst[:, 0]`` / prefill dst / chunk checkpoints), which
prefix caching requires of the model.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmamba.engine.block_pool import ROOT_HASH, block_hashes, hash_block_tokens
from jaxmamba.engine.prefix_cache import PrefixCacheManager, cdiv
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.metadata import (
    build_common_metadata,
    build_mamba_metadata,
    mamba_block_table_columns,
    reorder_batch,
)

M61 = (1 << 61) - 1


def step_val(v: int, tok: int) -> int:
    return (v * 1_000_003 + tok + 1) % M61


def prefix_values(tokens) -> list[int]:
    out = [0]
    for t in tokens:
        out.append(step_val(out[-1], t))
    return out


def make(mode="all", k=0, bs=4, mml=64, nkv=64, nst=64, **kw) -> PrefixCacheManager:
    return PrefixCacheManager(nkv, nst, bs, mode, k, max_model_len=mml, **kw)


def prefill(pm: PrefixCacheManager, rid: str, tokens, chunks=None, aligned=False):
    """Admit ``rid`` and compute its whole prompt; returns the hit.

    The first step computes what admission decided (``hit.num_new_tokens``, budget
    ``chunks[0]``); later steps take ``chunks[i]`` tokens (cut to block ends by
    ``align_prefill_chunk`` when ``aligned``).
    """
    n = len(tokens)
    chunks = chunks or [n]
    hit = pm.allocate_for_new_request(rid, tokens, chunks[0])
    assert hit is not None
    c, q, i = hit.num_cached_tokens, hit.num_new_tokens, 1
    while True:
        assert q > 0
        assert pm.allocate_more(rid, c + q)
        pm.commit(rid, c + q, tokens)
        pm.check_invariants()
        c += q
        if c >= n:
            return hit
        want = min(chunks[min(i, len(chunks) - 1)], n - c)
        q = pm.align_prefill_chunk(c, n, want) if aligned else want
        i += 1


def seq(n, start=0, alphabet=1000):
    return [(start + 7 * i) % alphabet for i in range(n)]


# =========================================================================== hashing


def test_block_hashes_are_chained_and_stable():
    toks = list(range(12))
    hs = block_hashes(toks, 4)
    assert len(hs) == 3
    assert hs[0] == hash_block_tokens(ROOT_HASH, [0, 1, 2, 3])
    assert hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])
    assert block_hashes(toks, 4) == hs  # deterministic
    # Same block content after a different parent: different hash.
    other = block_hashes([9, 9, 9, 9] + toks[4:8], 4)
    assert other[1] != hs[1]
    assert block_hashes(toks[:11], 4) == hs[:2]  # only full blocks


# ================================================= configuration / docs/architecture.md, Rule 2


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("bs,mml", [(4, 64), (4, 65), (16, 100), (8, 8)])
def test_state_indices_row_has_seed001_column_count(mode, k, bs, mml):
    pm = make(mode, k, bs=bs, mml=mml)
    want = cdiv(mml, bs) + k if mode != "none" else 1 + k
    assert pm.num_state_columns == want == mamba_block_table_columns(mode, mml, bs, k)
    hit = pm.allocate_for_new_request("r", seq(min(mml, 7)), 7)
    assert hit is not None
    row = pm.state_indices_row("r")
    assert row.shape == (want,) and row.dtype == np.int32
    assert pm.block_table_row("r").shape == (cdiv(mml, bs),)
    if mode == "none":
        assert np.all(row > 0)  # one slot + num_spec spec slots, all private
    else:
        blk_s = cdiv(hit.num_new_tokens, bs) - 1
        assert np.all(row[blk_s : blk_s + k + 1] > 0)  # the 1 + num_spec columns a decode writes
        assert pm.allocate_more("r", min(mml, 7))
        blk_s = cdiv(min(mml, 7), bs) - 1
        assert np.all(pm.state_indices_row("r")[blk_s : blk_s + k + 1] > 0)
    pm.check_invariants()
    # The runner's batch form: the same rows, stacked, in the order asked.
    assert pm.allocate_for_new_request("s", seq(min(mml, 5)), 5) is not None
    rows = pm.state_indices_rows(["s", "r", "s"])
    assert rows.dtype == np.int32 and rows.shape == (3, want)
    for got, rid in zip(rows, ["s", "r", "s"]):
        assert np.array_equal(got, pm.state_indices_row(rid))
    assert pm.state_indices_rows([]).shape == (0, want)
    with pytest.raises(SlotError, match="holds no cache blocks"):
        pm.state_indices_rows(["r", "nobody"])


def test_config_validation():
    with pytest.raises(ConfigError, match="multiple of mamba_chunk_size"):
        make("all", bs=6, mamba_chunk_size=4)
    make("none", bs=6, mamba_chunk_size=4)  # no block-end states in mode none
    make("align", bs=8, mamba_chunk_size=4)
    with pytest.raises(ConfigError, match="cache_mode"):
        make("some")
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        make(nkv=1)
    with pytest.raises(ConfigError, match="num_state_slots"):
        make(nst=1)
    with pytest.raises(ConfigError):
        PrefixCacheManager(8, 8, 4, "all", has_attention=False, has_mamba=False, max_model_len=16)
    with pytest.raises(ValueError):  # every bad input is a ValueError
        make(bs=0)


def test_bad_inputs_raise_value_errors():
    pm = make("all", mml=16)
    with pytest.raises(RequestError, match="max_model_len"):
        pm.allocate_for_new_request("a", seq(17), 4)
    with pytest.raises(RequestError):
        pm.allocate_for_new_request("a", [], 4)
    pm.allocate_for_new_request("a", seq(8), 8)
    with pytest.raises(SlotError, match="already"):
        pm.allocate_for_new_request("a", seq(8), 8)
    with pytest.raises(SlotError, match="holds no cache blocks"):
        pm.allocate_more("zzz", 4)
    with pytest.raises(RequestError, match="went back"):
        pm.commit("a", 8, seq(8))
        pm.commit("a", 4, seq(8))
    with pytest.raises(RequestError, match="only a multi-token decode"):
        pm.allocate_more("a", 10)
        pm.commit("a", 9, seq(10), num_scheduled_tokens=2)
    pm.free("a")
    pm.free("a")  # unknown ids are ignored
    pm.check_invariants()


# =========================================================================== hits


@pytest.mark.parametrize("mode", ["all", "align"])
def test_repeated_prompt_hits(mode):
    pm = make(mode)
    p = seq(14)
    prefill(pm, "a", p, chunks=[16], aligned=True)
    pm.free("a")
    hit = pm.allocate_for_new_request("b", p, 16)
    assert hit.num_cached_tokens == 12 and hit.num_new_tokens == 2
    assert pm.stats.num_hit_tokens == 12 and pm.stats.num_query_tokens == 28
    assert pm.stats.hit_rate == pytest.approx(12 / 28)
    assert pm.stats.num_queries == 2 and pm.stats.num_hit_requests == 1
    pm.check_invariants()


def test_align_mode_keeps_only_step_end_states():
    """Align mode stores no state at block ends inside a chunk (vLLM's align); mode all stores them all."""
    p = seq(14)
    pm = make("align")
    hit = prefill(pm, "a", p, chunks=[14])  # admission cuts the chunk to 12: blocks 0..2 in one step
    assert hit.num_new_tokens == 12
    pm.free("a")
    assert pm.num_cached_blocks == 3 and pm.num_cached_states == 1  # blocks 0, 1: KV-only links
    assert pm.lookup(p).num_cached_tokens == 12
    assert pm.lookup(p[:8] + [1]).num_cached_tokens == 0  # no state at block 1's end
    prefill(pm, "b", p[:8] + [1], chunks=[4])  # now a step ends at 4 and one at 8
    assert pm.lookup(p[:8] + [2]).num_cached_tokens == 8
    pm2 = make("all")
    prefill(pm2, "a", p, chunks=[14])  # mode all: one unaligned step, every block end checkpointed
    assert pm2.num_cached_states == 3
    assert pm2.lookup(p[:8] + [1]).num_cached_tokens == 8
    assert pm2.lookup(p).num_cached_tokens == 12
    # Align mode also keeps a checkpoint that lands in an allocated column (a chunk starting mid-block).
    pm3 = make("align")
    prefill(pm3, "a", p, chunks=[4, 6])  # steps 0-4, 4-10 (unaligned), 10-14
    assert pm3.lookup(p).num_cached_tokens == 12  # 12: checkpoint in the read column of the step 10-14
    assert pm3.lookup(p[:8] + [1]).num_cached_tokens == 4  # 8 lies inside the step 4-10: no state


def test_align_prefill_chunk_rule():
    pm = make("align", bs=4)
    assert pm.align_prefill_chunk(0, 14, 10) == 8  # cut back to a block end
    assert pm.align_prefill_chunk(0, 14, 14) == 12  # stop on the last block end before the tail
    assert pm.align_prefill_chunk(12, 14, 2) == 2  # the tail runs as given
    assert pm.align_prefill_chunk(0, 14, 3) == 0  # cannot reach a block end now
    # Prompt of whole blocks: the last block end strictly before the last token is
    # kept too, so an identical prompt can hit (its hit stops at len - 1).
    assert pm.align_prefill_chunk(0, 16, 16) == 12
    assert pm.align_prefill_chunk(12, 16, 4) == 4
    assert make("all").align_prefill_chunk(0, 14, 10) == 10


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["all", "align"]),
    bs=st.sampled_from([2, 4, 8]),
    m=st.integers(0, 40),
    la=st.integers(1, 20),
    lb=st.integers(1, 20),
    chunk=st.integers(1, 24),
    a_running=st.booleans(),
)
def test_shared_prefix_hit_length(mode, bs, m, la, lb, chunk, a_running):
    """Shared prefixes on and off block boundaries: the hit is the longest block-aligned common
    prefix whose last block has a state, stopping before the last token."""
    pm = make(mode, bs=bs, mml=128, nkv=128, nst=128)
    common = seq(m, 3)
    a = common + seq(la, 501)
    b = common + seq(lb, 777)
    lcp = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    # Drive A: admission decides the first step (align: cut to a block end), then fixed chunks.
    hit = pm.allocate_for_new_request("a", a, max(chunk, bs))
    c, q, ends, starts = 0, hit.num_new_tokens, [], []
    while c < len(a):
        assert pm.allocate_more("a", c + q)
        pm.commit("a", c + q, a)
        starts.append(c)
        c += q
        ends.append(c)
        q = min(chunk, len(a) - c)
    if not a_running:
        pm.free("a")
    limit = bs * min(lcp // bs, len(a) // bs, (len(b) - 1) // bs)
    if mode == "all":
        want = limit
    else:  # states at step ends on block ends, and at the first block end after a mid-block start
        have = {e for e in ends if e % bs == 0}
        have |= {cdiv(s, bs) * bs for s, e in zip(starts, ends) if s % bs and cdiv(s, bs) * bs < e}
        want = max([e for e in have if e <= limit], default=0)
    got = pm.allocate_for_new_request("b", b, 1000)
    assert got.num_cached_tokens == want
    assert got.num_cached_tokens < len(b)
    assert got.num_new_tokens == pm.align_prefill_chunk(want, len(b), len(b) - want)  # mode all: len(b) - want
    pm.check_invariants()


@pytest.mark.parametrize("mode", ["all", "align"])
def test_full_prompt_hit_backs_off_to_a_block_end_with_state(mode):
    pm = make(mode, bs=4)
    p = seq(16)
    prefill(pm, "a", p, chunks=[16], aligned=True)
    # An identical prompt of whole blocks: at least one token must be computed.
    hit = pm.lookup(p)
    assert hit.num_cached_tokens == 12 and hit.num_new_tokens == 4
    # One more token: the hit covers all four blocks and leaves exactly one token
    # (the seed-000 one-token extend with prior state).
    prefill(pm, "b", p + [5], chunks=[17], aligned=True)
    pm.free("a")
    q = p + [5, 6]
    hit = pm.allocate_for_new_request("c", q, 100)
    assert hit.num_cached_tokens == 16 and hit.num_new_tokens == 2
    row = pm.state_indices_row("c")
    assert row[3] == hit.state_slot != 0  # block of the last computed token: the shared slot
    assert row[4] != 0 and row[4] != hit.state_slot  # block of the last scheduled token: fresh
    assert pm._state.refs[row[4]] == 1 and row[4] not in pm._state.cached
    pm.check_invariants()
    # Through the real builder: the first step reads the shared slot and writes the fresh one.
    common = build_common_metadata(
        num_reqs=1, num_computed_tokens=[16], num_scheduled_tokens=[1], num_prompt_tokens=[17],
        block_table=pm.block_table_row("c")[None], block_size=4, num_reqs_padded=1,
        num_tokens_padded=1, max_model_len=64,
    )
    md = build_mamba_metadata(common, state_indices=row[None], cache_mode=mode, block_size=4,
                              num_speculative_blocks=0, chunk_size=4, num_slots=64)
    assert int(md.num_decodes) == 1  # Rule 1 (docs/architecture.md)
    assert md.state_indices_decode[0, 0] == hit.state_slot
    assert md.state_indices_decode_dst[0, 0] == row[4]


def test_mode_none_never_reuses():
    pm = make("none", k=2)
    p = seq(20)
    for r in ("a", "b"):
        hit = prefill(pm, r, p, chunks=[8])
        assert hit.num_cached_tokens == 0
        row = pm.state_indices_row(r)
        assert row.shape == (3,) and np.all(row > 0)
    assert pm.num_cached_blocks == 0 and pm.num_cached_states == 0
    assert pm.lookup(p).num_cached_tokens == 0
    assert set(pm.state_indices_row("a")).isdisjoint(pm.state_indices_row("b"))
    pm.free("a")
    pm.free("b")
    assert pm.num_used_kv_blocks == pm.num_used_state_slots == 0
    assert pm.stats.num_queries == 0
    pm.check_invariants()


@pytest.mark.parametrize("mode", ["none", "all", "align"])
def test_kv_lists_changed_names_every_list_made_or_grown(mode):
    """The runner's block table reads only the lists the manager names (``kv_lists_changed``): admission
    and every allocation that adds KV blocks name the request; a step inside its blocks does not; a
    freed request leaves the set (a re-admission makes a new list and names it again)."""
    pm = make(mode, bs=4)
    pm.kv_lists_changed.clear()
    tokens = seq(12)
    hit = pm.allocate_for_new_request("a", tokens, 6)
    assert hit is not None and pm.kv_lists_changed == {"a"}
    pm.kv_lists_changed.clear()
    kv = pm.kv_block_list("a")
    end = hit.num_cached_tokens + hit.num_new_tokens
    assert pm.allocate_more("a", end) and pm.kv_lists_changed == set()  # inside the blocks it holds
    pm.commit("a", end, tokens)
    assert pm.allocate_more("a", len(kv) * 4 + 1) and pm.kv_block_list("a") is kv and len(kv) == cdiv(end, 4) + 1
    assert pm.kv_lists_changed == {"a"}
    pm.free("a")
    assert pm.kv_lists_changed == set()
    assert pm.allocate_for_new_request("a", tokens, 6) is not None and pm.kv_lists_changed == {"a"}


@pytest.mark.parametrize("mode", ["none", "all", "align"])
def test_commit_decodes_equal_one_token_commits(mode):
    """The engine's per-row decode commits (``commit_decode``, and ``commit_decodes`` for a step's rows
    together) leave every request as ``commit(..., num_scheduled_tokens=1)`` leaves it, the short path of a
    plain manager included, and refuse the same bad steps."""
    managers = [make(mode, bs=4, mml=64) for _ in range(3)]
    prompts = {"a": seq(6), "b": seq(9, start=3), "c": seq(3, start=5)}
    for pm in managers:
        for rid, tokens in prompts.items():
            prefill(pm, rid, tokens)
    known = {rid: list(tokens) for rid, tokens in prompts.items()}
    for step in range(10):  # crosses block ends: new KV blocks (and, caching, full blocks to cache)
        for rid in known:
            known[rid].append((step * 31 + len(rid)) % 1000)
        ends = {rid: len(toks) for rid, toks in known.items()}
        for pm in managers:
            for rid, end in ends.items():
                assert pm.allocate_more(rid, end)
        for rid, end in ends.items():
            managers[0].commit(rid, end, known[rid], num_scheduled_tokens=1)
            managers[1].commit_decode(rid, end, known[rid])
        if managers[2].plain:
            managers[2].commit_decodes(list(ends), list(ends.values()))
        else:
            for rid, end in ends.items():
                managers[2].commit_decode(rid, end, known[rid])
        for pm in managers:
            pm.check_invariants()
        for rid in known:
            want = managers[0]._reqs[rid]
            for pm in managers[1:]:
                got = pm._reqs[rid]
                assert (got.num_computed, got.num_accepted, got.prev_last_block, got.kv, got.table) == (
                    want.num_computed, want.num_accepted, want.prev_last_block, want.kv, want.table), (mode, rid)
        assert managers[1].num_cached_blocks == managers[0].num_cached_blocks
    # A step past the request's blocks is refused, never counted.
    for pm in managers[1:]:
        end = len(pm._reqs["a"].kv) * 4 + 1
        pm._reqs["a"].num_computed = end - 1
        with pytest.raises(SlotError):
            if pm.plain:
                pm.commit_decodes(["a"], [end])
            else:
                pm.commit_decode("a", end, known["a"] + [0] * 64)
        assert pm._reqs["a"].num_computed == end - 1


def test_attention_only_and_mamba_only_models():
    att = PrefixCacheManager(32, 0, 4, "none", has_mamba=False, max_model_len=64)
    p = seq(14)
    prefill(att, "a", p)
    assert att.lookup(p).num_cached_tokens == 12  # attention-only: plain chain, any mode
    assert np.all(att.state_indices_row("a") == 0)
    mam = PrefixCacheManager(0, 32, 4, "all", has_attention=False, max_model_len=64)
    prefill(mam, "a", p)
    assert mam.lookup(p).num_cached_tokens == 12
    assert mam.block_table_row("a").sum() == 0
    mam.free("a")
    assert mam.num_used_state_slots == 0 and mam.num_cached_states == 3
    mam.check_invariants()
    att.check_invariants()


# =========================================================================== eviction


def test_eviction_lru_order_and_stats():
    pm = make("all", bs=4, nkv=7, nst=32)  # 6 usable KV blocks
    a, b, c = seq(8, 1), seq(8, 2), seq(12, 3)
    prefill(pm, "a", a)
    pm.free("a")
    prefill(pm, "b", b)
    pm.free("b")
    assert pm.num_used_kv_blocks == 0 and pm.num_cached_blocks == 4
    assert pm.lookup(a + [0]).num_cached_tokens == 8
    prefill(pm, "c", c)  # needs 3 blocks: 2 free + 1 evicted: A's tail block (least recently freed)
    assert pm.stats.num_kv_evictions == 1
    assert pm.lookup(a + [0]).num_cached_tokens == 4
    assert pm.lookup(b + [0]).num_cached_tokens == 8
    pm.check_invariants()
    # A hit takes its blocks off the evictable queue: they survive further pressure.
    hit = pm.allocate_for_new_request("b2", b + [0], 1)
    assert hit.num_cached_tokens == 8
    pm.free("c")
    d = seq(12, 4)
    prefill(pm, "d", d)
    assert pm.lookup(b + [0]).num_cached_tokens == 8
    pm.check_invariants()


def test_state_eviction_keeps_kv_links_and_hit_falls_back():
    pm = make("all", bs=4, nkv=64, nst=6)  # 5 usable state slots
    p = seq(12)
    prefill(pm, "a", p)  # states of blocks 0, 1, 2; commit releases 1 then 0, free releases 2
    pm.free("a")
    assert pm.num_cached_states == 3 and pm.num_cached_blocks == 3
    prefill(pm, "x", seq(8, 9))  # 2 slots: the free list has 2, no eviction
    assert pm.stats.num_state_evictions == 0
    prefill(pm, "y", seq(4, 11))  # 1 slot: evicts the least recently released state, block 1's
    assert pm.stats.num_state_evictions == 1 and pm.stats.num_kv_evictions == 0
    assert pm.num_cached_blocks == 3 + 2 + 1  # A's entries all stay (block 1 as a KV-only link)
    assert pm.lookup(p + [1]).num_cached_tokens == 12  # the chain runs through the KV-only link
    assert pm.lookup(p[:8] + [1]).num_cached_tokens == 4  # falls back to block 0's state
    pm.check_invariants()


def test_allocation_failure_changes_nothing():
    pm = make("all", bs=4, nkv=5, nst=32)
    prefill(pm, "a", seq(12))
    before = (pm.num_free_kv_blocks, pm.num_free_state_slots, pm.num_cached_blocks)
    assert pm.allocate_for_new_request("b", seq(12, 5), 12) is None  # 1 block left, 3 needed
    assert (pm.num_free_kv_blocks, pm.num_free_state_slots, pm.num_cached_blocks) == before
    assert not pm.has_request("b")
    assert not pm.allocate_more("a", 24)
    assert pm.allocate_more("a", 16)
    pm.check_invariants()


def test_hit_blocks_are_not_counted_as_available():
    """The blocks a hit shares leave the evictable queue, so they cannot also be handed out."""
    pm = make("all", bs=4, nkv=5, nst=32)  # 4 usable
    p = seq(12)
    prefill(pm, "a", p)
    pm.free("a")  # 3 cached blocks evictable + 1 free
    assert pm.num_free_kv_blocks == 4
    # Hit of 2 blocks (12 tokens + 1, limit (13-1)//4 = 3 -> 3 blocks) + 2 new blocks for 9 more tokens
    # would need 3 shared + 3 new > 4.
    assert pm.allocate_for_new_request("b", p + seq(9, 50), 100) is None
    hit = pm.allocate_for_new_request("b", p + seq(1, 50), 100)
    assert hit.num_cached_tokens == 12
    pm.check_invariants()


# =========================================================================== never write a shared slot


@pytest.mark.parametrize("mode", ["all", "align"])
def test_no_writable_slot_is_shared(mode):
    pm = make(mode, k=2)
    p = seq(13)
    prefill(pm, "a", p, chunks=[4], aligned=True)  # A keeps running
    hits = [pm.allocate_for_new_request(r, p + [r_i], 3) for r_i, r in enumerate("bcd")]
    assert all(h.num_cached_tokens == 12 for h in hits)
    shared = hits[0].state_slot
    assert all(h.state_slot == shared for h in hits)
    assert pm._state.refs[shared] == 3  # b, c, d (A released it, it stays cached)
    for r in "bcd":
        for s in (13, 14, 16):
            assert pm.allocate_more(r, s)
            for j in pm.write_columns(r, s):
                slot = pm.state_table(r)[j]
                assert slot != shared and pm._state.refs[slot] == 1 and slot not in pm._state.cached
    pm.check_invariants()
    # The check catches a table that would write a shared slot (the rule can fail).
    req = pm._reqs["b"]
    old, other = req.table[4], pm._reqs["c"].table[4]  # b would write c's private slot
    req.table[4] = other
    pm._state.refs[other] += 1
    pm._state.release(old)
    with pytest.raises(SlotError, match="writable but shared"):
        pm.check_invariants()


def test_check_invariants_detects_leaks_and_bad_refcounts():
    pm = make("all")
    prefill(pm, "a", seq(9))
    pm.check_invariants()
    pm._kv.free.popleft()  # an id vanishes
    with pytest.raises(SlotError, match="leaked"):
        pm.check_invariants()
    pm = make("all")
    prefill(pm, "a", seq(9))
    pm._state.refs[pm.state_table("a")[2]] += 1
    with pytest.raises(SlotError):
        pm.check_invariants()
    pm = make("all")
    prefill(pm, "a", seq(9))
    h = next(iter(pm._entries))
    pm._entries[h].kv = 63  # a hash pointing at a block it does not own
    with pytest.raises(SlotError):
        pm.check_invariants()


# =========================================================================== speculative decoding


def test_spec_decode_columns_and_align_rotation():
    """A multi-token decode writes 1 + num_spec columns from the block of its last scheduled token; in
    align mode the manager rotates the window to the block of the last computed token."""
    k, bs = 2, 4
    pm = make("align", k=k, bs=bs)
    p = seq(7)
    prefill(pm, "a", p, aligned=True)  # steps end at 4 (block 0's state kept) and 7; read column 1
    assert pm.allocate_more("a", 10)  # positions 7, 8, 9: blk_s = 2 -> columns 2..4
    row = pm.state_table("a")
    window = row[2:5]
    assert all(window)
    pm.commit("a", 8, p + [1, 2, 3], num_scheduled_tokens=3, multi_token_decode=True)  # 1 accepted
    row2 = pm.state_table("a")
    assert row2[1:4] == window  # window now anchored at blk_c = 1
    assert pm.num_accepted_tokens("a") == 1 and pm.prev_step_last_block("a") == -1
    assert pm.num_cached_states == 1  # only block 0's end state (from the prefill); not block 1's
    pm.check_invariants()
    pm2 = make("all", k=k, bs=bs)
    prefill(pm2, "a", p)
    assert pm2.allocate_more("a", 10)
    before = pm2.state_table("a")
    pm2.commit("a", 10, p + [1, 2, 3], num_scheduled_tokens=3, multi_token_decode=True)  # all accepted
    assert pm2.prev_step_last_block("a") == 2 and pm2.num_accepted_tokens("a") == 3
    assert pm2.state_table("a")[2:5] == before[2:5]  # mode all: no rotation (Rule 2's prev-step anchor)
    pm2.check_invariants()


# =========================================================================== simulation


class Sim:
    """A small engine over the manager and the real metadata builders, with a fake device."""

    def __init__(self, mode, k, *, seed, bs=4, chunk_size=2, mml=48, nkv=40, nst=40, max_seqs=6,
                 budget=20, p_preempt=0.03, p_draft_ok=0.6, vocab=6, check_device=True):
        self.mode, self.k, self.bs, self.cs, self.mml = mode, k, bs, chunk_size, mml
        self.nkv, self.nst = nkv, nst
        self.pm = PrefixCacheManager(nkv, nst, bs, mode, k, max_model_len=mml, mamba_chunk_size=chunk_size)
        self.rng = np.random.default_rng(seed)
        self.max_seqs, self.budget = max_seqs, budget
        self.p_preempt, self.p_draft_ok, self.vocab = p_preempt, p_draft_ok, vocab
        self.check_device = check_device
        self.adding = True
        self.kv: dict[int, int] = {}
        self.ssm: dict[int, int] = {}
        self.conv: dict[int, tuple] = {}
        self.reqs: dict[str, dict] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.arrival = 0
        self.steps = 0
        self.finished = 0
        self.preemptions = 0
        self.max_decode_q = 0
        bases = [self._toks(int(self.rng.integers(1, 30))) for _ in range(4)]
        bases += [b[: bs * (len(b) // bs)] for b in bases]  # on block boundaries too
        self.bases = bases

    def _toks(self, n):
        return [int(x) for x in self.rng.integers(0, self.vocab, n)]

    def add_request(self):
        rng = self.rng
        prompt = list(self.bases[int(rng.integers(len(self.bases)))]) if rng.random() < 0.7 else []
        prompt += self._toks(int(rng.integers(0 if prompt else 1, 12)))
        prompt = prompt[: self.mml - 2]
        total = min(len(prompt) + int(rng.integers(1, 14)), self.mml)
        full = prompt + self._toks(total - len(prompt))
        rid = f"r{self.arrival}"
        self.reqs[rid] = dict(full=full, pv=prefix_values(full), prompt=len(prompt), known=len(prompt),
                              adm_prompt=len(prompt), arrival=self.arrival)
        self.arrival += 1
        self.waiting.append(rid)

    # -------------------------------------------------------------- scheduling
    def _preempt(self, rid):
        self.pm.free(rid)
        self.running.remove(rid)
        self.waiting.appendleft(rid)
        self.preemptions += 1

    def schedule(self):
        pm, rows, budget = self.pm, [], self.budget
        for rid in sorted(self.running, key=lambda r: self.reqs[r]["arrival"]):
            if rid not in self.running or len(rows) == self.max_seqs or budget == 0:
                continue
            r = self.reqs[rid]
            c = pm.num_computed_tokens(rid)
            if c < r["adm_prompt"]:  # prefill chunk
                q = min(r["known"] - c, budget, int(self.rng.integers(1, 2 * self.bs + 3)))
                q = pm.align_prefill_chunk(c, r["known"], q)
                if q == 0:
                    continue
                toks = r["full"][c : c + q]
            else:  # decode: the last sampled token + drafts
                assert r["known"] == c + 1
                nd = min(self.k, len(r["full"]) - r["known"] - 1, budget - 1)
                nd = int(self.rng.integers(0, nd + 1)) if nd > 0 else 0
                drafts = []
                for i in range(nd):
                    true = r["full"][c + 1 + i]
                    ok = self.rng.random() < self.p_draft_ok
                    drafts.append(true if ok else (true + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab)
                toks = [r["full"][c]] + drafts
                q = len(toks)
            while not pm.allocate_more(rid, c + q):
                victim = max(self.running, key=lambda x: self.reqs[x]["arrival"])
                self._preempt(victim)
                if victim == rid:
                    break
            if rid not in self.running:
                continue
            rows.append((rid, c, toks))
            budget -= q
        while self.waiting and len(rows) < self.max_seqs and budget > 0:
            rid = self.waiting[0]
            r = self.reqs[rid]
            hit = pm.allocate_for_new_request(rid, r["full"][: r["known"]], budget)
            if hit is None:
                break
            self.waiting.popleft()
            self.running.append(rid)
            r["adm_prompt"] = r["known"]  # a resumed request recomputes its outputs as prompt
            c, q = hit.num_cached_tokens, hit.num_new_tokens
            assert c % self.bs == 0 and c < r["known"] and 0 < q <= budget
            assert pm.align_prefill_chunk(c, r["known"], q) == q
            assert pm.allocate_more(rid, c + q)  # idempotent: already holds what the step needs
            rows.append((rid, c, r["full"][c : c + q]))
            budget -= q
        return rows

    # -------------------------------------------------------------- one step
    def step(self):
        pm, bs, k = self.pm, self.bs, self.k
        if self.adding and (self.rng.random() < 0.6 or not (self.running or self.waiting)):
            self.add_request()
        rows = self.schedule()
        self.steps += 1
        if not rows:
            assert self.running or self.waiting
            return
        n = len(rows)
        computed = np.array([c for _, c, _ in rows])
        q = np.array([len(t) for _, _, t in rows])
        prompt = np.array([self.reqs[rid]["adm_prompt"] for rid, _, _ in rows])
        order = reorder_batch(q, computed < prompt, computed + q, decode_threshold=1 + k)
        rows = [rows[i] for i in order]
        computed, q, prompt = computed[order], q[order], prompt[order]
        rids = [rid for rid, _, _ in rows]
        bt = np.stack([pm.block_table_row(rid) for rid in rids])
        si = np.stack([pm.state_indices_row(rid) for rid in rids])
        assert si.shape[1] == mamba_block_table_columns(self.mode, self.mml, bs, k)  # Rule 2, every step
        acc = np.array([pm.num_accepted_tokens(rid) for rid in rids])
        prev = np.array([pm.prev_step_last_block(rid) for rid in rids])
        common = build_common_metadata(
            num_reqs=n, num_computed_tokens=computed, num_scheduled_tokens=q, num_prompt_tokens=prompt,
            block_table=bt, block_size=bs, num_reqs_padded=n + 1, num_tokens_padded=int(q.sum()) + 2,
            max_model_len=self.mml, decode_threshold=1 + k, num_blocks=self.nkv,
        )
        md = build_mamba_metadata(
            common, state_indices=si, cache_mode=self.mode, block_size=bs, num_speculative_blocks=k,
            num_accepted_tokens=acc if k else None,
            prev_step_last_block=prev if (k and self.mode == "all") else None,
            chunk_size=self.cs, num_slots=self.nst,
        )
        nd = int(md.num_decodes)
        vals = []  # per row: prefix value after each scheduled token
        for rid, c, toks in rows:
            v = [self.reqs[rid]["pv"][c]]
            for t in toks:
                v.append(step_val(v[-1], t))
            vals.append(v[1:])
        if self.check_device:
            self._execute(rows, md, common, nd, vals)
        # ---- sample / accept, then commit
        for i, (rid, c, toks) in enumerate(rows):
            r = self.reqs[rid]
            qi = len(toks)
            multi = i < nd and qi > 1
            self.max_decode_q = max(self.max_decode_q, qi if i < nd else 0)
            if c >= r["adm_prompt"]:  # decode row: accept the leading correct drafts
                a = 1
                while a < qi and toks[a] == r["full"][c + a]:
                    a += 1
            else:
                a = qi
            c_new = c + a
            if c_new == r["known"] or c >= r["adm_prompt"]:
                r["known"] = c_new + 1  # the sampled (bonus) token
            pm.commit(rid, c_new, r["full"][: r["known"]], num_scheduled_tokens=qi, multi_token_decode=multi)
            if r["known"] >= len(r["full"]):
                pm.free(rid)
                self.running.remove(rid)
                self.finished += 1
        if self.running and self.rng.random() < self.p_preempt:
            self._preempt(self.running[int(self.rng.integers(len(self.running)))])
        pm.check_invariants()

    def _execute(self, rows, md, common, nd, vals):
        """Run the step on the fake device and check every value read."""
        pm, bs = self.pm, self.bs
        n = len(rows)
        qsl = np.asarray(common.query_start_loc)
        sm = np.asarray(common.slot_mapping)
        bt = np.asarray(common.block_table)
        writers: dict[int, int] = {}  # state slot -> row
        readers: dict[int, set] = {}
        kv_writes: dict[int, int] = {}

        def write_state(slot, row, ssm_val=None, conv_hist=None):
            slot = int(slot)
            if slot < 0:  # PAD: skip
                return
            assert slot > 0, "the null slot was written"
            assert pm._state.refs[slot] == 1 and slot not in pm._state.cached, f"slot {slot} written while shared"
            assert writers.setdefault(slot, row) == row, f"slot {slot} written by two rows"
            w = pending.setdefault(slot, {})
            if ssm_val is not None:
                w["ssm"] = ssm_val
            if conv_hist is not None:
                w["conv"] = conv_hist

        def read_state(slot, row, expect, conv_offset=0):
            slot = int(slot)
            assert slot > 0
            assert self.ssm.get(slot) == expect, f"row {row}: SSM state in slot {slot} is stale"
            readers.setdefault(slot, set()).add(row)

        pending: dict[int, dict] = {}
        # KV: all rows write, then attention reads every position of every row.
        for i in range(n):
            for t in range(qsl[i], qsl[i + 1]):
                s = int(sm[t])
                assert s >= bs, "KV write to the null block"
                assert s not in kv_writes, "two tokens write one KV slot"
                b = s // bs
                assert pm._kv.refs[b] == 1 and b not in pm._kv.cached, f"KV block {b} written while shared"
                kv_writes[s] = vals[i][t - qsl[i]]
        self.kv.update(kv_writes)
        for i, (rid, c, toks) in enumerate(rows):
            pv = self.reqs[rid]["pv"]
            for p in range(c + len(toks)):
                want = pv[p + 1] if p < c else vals[i][p - c]
                assert self.kv.get(int(bt[i, p // bs]) * bs + p % bs) == want, f"row {i}: KV of position {p}"
        # Mamba decode rows.
        spec = self.k > 0
        for i in range(nd):
            rid, c, toks = rows[i]
            want = self.reqs[rid]["pv"][c]
            src = np.asarray(md.state_indices_decode[i])
            dst = np.asarray(md.state_indices_decode_dst[i])
            a = int(md.num_accepted_tokens[i]) if spec else 1
            read_state(src[a - 1], i, want)
            hist = self.conv.get(int(src[0]))
            off = a - 1 if spec else 0
            assert hist is not None and off < len(hist) and hist[off] == want, f"row {i}: conv state is stale"
            readers.setdefault(int(src[0]), set()).add(i)
            for t in range(len(toks)):  # token t's SSM state -> column t of the destination window
                write_state(dst[t], i, ssm_val=vals[i][t])
            write_state(dst[0], i, conv_hist=tuple(vals[i]))  # conv history -> column 0
        # Mamba prefill rows.
        npf = int(md.num_prefills)
        qslp = np.asarray(md.query_start_loc_prefill)
        cu = np.asarray(md.cu_chunk_seqlens)
        sidx = np.asarray(md.seq_idx)
        ck = np.asarray(md.state_indices_chunk_checkpoint)
        nchunks = int(np.asarray(md.last_chunk_indices)[npf - 1]) + 1 if npf else 0
        for j in range(npf):
            i = nd + j
            rid, c, toks = rows[i]
            if bool(md.has_initial_state[j]):
                slot = int(md.state_indices_prefill_initial[j])
                read_state(slot, i, self.reqs[rid]["pv"][c])
                hist = self.conv.get(slot)
                assert hist is not None and len(hist) == 1 and hist[0] == self.reqs[rid]["pv"][c]
            else:
                assert c == 0
            final = vals[i][-1]
            write_state(md.state_indices_prefill[j], i, final, (final,))
        for ch in range(nchunks):
            if ck[ch] > 0:
                j = int(sidx[ch])
                done = int(cu[ch + 1] - qslp[j])
                rid, c, _ = rows[nd + j]
                assert (c + done) % bs == 0
                v = vals[nd + j][done - 1]
                write_state(ck[ch], nd + j, v, (v,))
        for slot, rs in readers.items():
            w = writers.get(slot)
            assert w is None or rs <= {w}, f"slot {slot} read by rows {rs} and written by row {w}"
        for slot, w in pending.items():
            # A slot gets a new conv history and SSM state together or not at all.
            self.ssm[slot] = w.get("ssm")
            self.conv[slot] = w.get("conv")

    def drain(self):
        for rid in list(self.running):
            self.pm.free(rid)
            self.running.remove(rid)
        self.pm.check_invariants()
        assert self.pm.num_used_kv_blocks == 0 and self.pm.num_used_state_slots == 0
        assert self.pm.usage == 0.0


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("k", [0, 2])
def test_simulated_engine_reads_correct_states(mode, k):
    """Real builders + fake device: every KV/state read matches the true prefix (hits, evictions,
    preemptions, spec decode with random acceptance)."""
    sim = Sim(mode, k, seed=1000 + 10 * k + len(mode), nst=26)
    for _ in range(220):
        sim.step()
    sim.drain()
    st_ = sim.pm.stats
    assert sim.finished > 20 and sim.preemptions > 0
    if mode == "none":
        assert st_.num_queries == 0
    else:
        assert st_.num_hit_tokens > 0 and st_.num_hit_requests > 5
        assert st_.num_kv_evictions > 0 and st_.num_state_evictions > 0
    if k:
        assert sim.max_decode_q == 1 + k  # multi-token decodes happened


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(["none", "align", "all"]), k=st.integers(0, 3),
       bs=st.sampled_from([2, 4, 8]))
def test_simulated_engine_property(seed, mode, k, bs):
    sim = Sim(mode, k, seed=seed, bs=bs, chunk_size=2, mml=6 * bs + 8, nkv=6 * bs + 10, nst=30)
    for _ in range(80):
        sim.step()
    sim.drain()


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_thousand_requests_leave_pools_empty(mode):
    """1,000 requests with random lengths, finishes and preemptions (manager only, spec decode on):
    invariants hold after every step and pool usage returns to zero."""
    sim = Sim(mode, 2, seed=7 + len(mode), check_device=False, p_preempt=0.08, nkv=48, nst=36)
    while sim.arrival < 1000:
        sim.step()
    sim.adding = False
    while sim.running or sim.waiting:
        sim.step()
    sim.drain()
    assert sim.finished == 1000 and sim.preemptions > 20
    assert sim.pm.stats.num_queries > 1000 if mode != "none" else sim.pm.stats.num_queries == 0
