"""Property tests of the metadata builders over random batches (hypothesis).

Each example draws a configuration (cache mode, speculative tokens, block and
chunk sizes), a batch mixing decodes, spec decodes, one-token extends with
prior state, short/long extends, first-chunk prefills and prefix-cached
restarts, orders it with ``reorder_batch``, and hands the builders persistent
buffers whose tail rows hold stale garbage. The invariants are checked against
expectations computed here independently of the builders.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.metadata import (
    batch_regions,
    build_common_metadata,
    build_mamba_metadata,
    mamba_block_table_columns,
    mamba_is_prefilling,
    num_chunks_for_bucket,
    pack,
    pad_to_bucket,
    reorder_batch,
    split_decodes_and_prefills,
    unpack,
)
from jaxmamba.metadata import classify
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS, gather_slot_indices

KINDS = ("decode", "extend1", "short_multi", "long_extend", "prefill", "restart")
GARBAGE = st.integers(-(10**6), 10**6)


def cdiv(a, b):
    return -(-a // b)


@dataclass
class Scenario:
    mode: str
    k: int  # speculative tokens (num_speculative_blocks)
    chunk_size: int
    mamba_bs: int
    attn_bs: int
    mml: int
    n: int
    R: int
    T: int
    computed: np.ndarray  # [n] real rows, in batch order
    q: np.ndarray
    prompt: np.ndarray
    drafts: np.ndarray | None
    accepted: np.ndarray | None
    prev: np.ndarray | None
    attn_table: np.ndarray  # [n, B]
    state_table: np.ndarray  # [n, C]
    num_slots: int
    num_blocks: int
    stale: dict  # name -> garbage rows appended to the persistent buffers

    @property
    def seq(self):
        return self.computed + self.q

    @property
    def prefilling(self):
        return self.computed < self.prompt

    def buffers(self, with_stale: bool) -> dict:
        def cat(name, real):
            return np.concatenate([real, self.stale[name]]) if with_stale else real

        return dict(
            computed=cat("computed", self.computed),
            q=cat("q", self.q),
            prompt=cat("prompt", self.prompt),
            attn_table=cat("attn_table", self.attn_table),
            state_table=cat("state_table", self.state_table),
            drafts=None if self.drafts is None else cat("drafts", self.drafts),
            accepted=None if self.accepted is None else cat("accepted", self.accepted),
            prev=None if self.prev is None else cat("prev", self.prev),
        )


def _row(draw, kind, k, mml, mamba_bs):
    """(computed, q, prompt) of one row of the given kind, with computed + q <= mml."""
    thr = 1 + k
    if kind == "decode":
        p = draw(st.integers(1, mml - 1))
        c = draw(st.integers(p, mml - 1))
        return c, draw(st.integers(1, min(thr, mml - c))), p
    if kind == "extend1" or (kind == "short_multi" and k == 0):
        p = draw(st.integers(2, mml))
        return draw(st.integers(1, p - 1)), 1, p
    if kind == "short_multi":
        p = draw(st.integers(3, mml))
        c = draw(st.integers(1, p - 2))
        return c, draw(st.integers(2, min(thr, p - c))), p
    if kind == "long_extend" and mml - thr - 1 >= 1:
        c = draw(st.integers(1, mml - thr - 1))
        q = draw(st.integers(thr + 1, mml - c))
        return c, q, draw(st.integers(c + q, mml))
    if kind == "restart" and mamba_bs < mml:
        c = mamba_bs * draw(st.integers(1, (mml - 1) // mamba_bs))
        q = draw(st.integers(1, mml - c))
        return c, q, draw(st.integers(c + q, mml))
    q = draw(st.integers(1, mml))
    return 0, q, draw(st.integers(q, mml))


@st.composite
def scenarios(draw):
    k = draw(st.sampled_from([2, 0, 1]))
    mode = draw(st.sampled_from(("all", "align", "none")))
    cs = draw(st.sampled_from([1, 2, 4, 8]))
    mamba_bs = cs * draw(st.integers(1, 3))
    attn_bs = draw(st.sampled_from([2, 4, 8, 16]))
    mml = draw(st.integers(24, 80))
    n = draw(st.integers(0, 7))
    rows = [_row(draw, draw(st.sampled_from(KINDS)), k, mml, mamba_bs) for _ in range(n)]
    computed = np.array([r[0] for r in rows], dtype=np.int64)
    q = np.array([r[1] for r in rows], dtype=np.int64)
    prompt = np.array([r[2] for r in rows], dtype=np.int64)
    drafts = None
    if k > 0 and draw(st.booleans()):
        tails = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
        drafts = np.where(tails & (q - 1 <= k), q - 1, -1)
    perm = reorder_batch(q, computed < prompt, computed + q, decode_threshold=1 + k, num_draft_tokens=drafts)
    computed, q, prompt = computed[perm], q[perm], prompt[perm]
    drafts = None if drafts is None else drafts[perm]
    seq = computed + q

    # Attention block table: distinct ids for used blocks, garbage after them.
    B = cdiv(mml, attn_bs)
    attn = np.array(draw(st.lists(GARBAGE, min_size=n * B, max_size=n * B)), dtype=np.int64).reshape(n, B)
    next_block = 1
    for i in range(n):
        used = cdiv(int(seq[i]), attn_bs)
        attn[i, :used] = np.arange(next_block, next_block + used)
        next_block += used

    # Mamba block table: distinct real slots from the last computed block on;
    # columns before it are never read and hold garbage (possibly out of range).
    C = mamba_block_table_columns(mode, mml, mamba_bs, k)
    table = np.zeros((n, C), dtype=np.int64)
    next_slot = 1
    for i in range(n):
        table[i] = np.arange(next_slot, next_slot + C)
        next_slot += C
        if mode != "none":
            first = max(cdiv(int(computed[i]), mamba_bs) - 1, 0)
            table[i, :first] = draw(st.lists(GARBAGE, min_size=first, max_size=first))
    num_slots = next_slot + draw(st.integers(0, 3))

    accepted = prev = None
    if k > 0 and draw(st.sampled_from([True, True, False])):
        accepted = np.array(draw(st.lists(st.integers(1, 1 + k), min_size=n, max_size=n)), dtype=np.int64)
    if mode == "all" and k > 0 and draw(st.sampled_from([True, True, False])):
        last_block = cdiv(mml, mamba_bs) - 1
        prev = np.array(
            [
                draw(st.sampled_from([-1, max(cdiv(int(c), mamba_bs) - 1, 0), min(cdiv(int(c), mamba_bs), last_block)]))
                for c in computed
            ],
            dtype=np.int64,
        )

    n_stale = draw(st.integers(0, 3))

    def garbage(shape):
        size = int(np.prod(shape))
        return np.array(draw(st.lists(GARBAGE, min_size=size, max_size=size)), dtype=np.int64).reshape(shape)

    stale = dict(
        computed=garbage((n_stale,)),
        q=garbage((n_stale,)),
        prompt=garbage((n_stale,)),
        attn_table=garbage((n_stale, B)),
        state_table=garbage((n_stale, C)),
        drafts=garbage((n_stale,)),
        accepted=garbage((n_stale,)),
        prev=garbage((n_stale,)),
    )
    R = max(n, 1) + draw(st.integers(0, 3))
    T = int(q.sum()) + draw(st.integers(0, 10))
    return Scenario(mode, k, cs, mamba_bs, attn_bs, mml, n, R, T, computed, q, prompt, drafts, accepted, prev, attn,
                    table, num_slots, next_block, stale)


def build(sc: Scenario, *, with_stale=True, R=None, T=None):
    b = sc.buffers(with_stale)
    common = build_common_metadata(
        num_reqs=sc.n,
        num_computed_tokens=b["computed"],
        num_scheduled_tokens=b["q"],
        num_prompt_tokens=b["prompt"],
        block_table=b["attn_table"],
        block_size=sc.attn_bs,
        num_reqs_padded=R or sc.R,
        num_tokens_padded=T or sc.T,
        max_model_len=sc.mml,
        decode_threshold=1 + sc.k,
        num_blocks=sc.num_blocks,
    )
    mamba = build_mamba_metadata(
        common,
        state_indices=b["state_table"],
        cache_mode=sc.mode,
        block_size=sc.mamba_bs,
        num_speculative_blocks=sc.k,
        num_accepted_tokens=b["accepted"],
        prev_step_last_block=b["prev"],
        chunk_size=sc.chunk_size,
        num_slots=sc.num_slots,
        num_decode_draft_tokens=b["drafts"],
    )
    return common, mamba


def leaves_equal(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


def reference_chunks(computed, q, cs):
    """Chunk list written the way vLLM's builder loop reads: finish the partial chunk, then whole ones."""
    cu, seq_idx, last, pos = [], [], [], 0
    for j, (c, n_new) in enumerate(zip(computed.tolist(), q.tolist())):
        if c % cs:
            take = min(cdiv(c, cs) * cs - c, n_new)
            cu.append(pos), seq_idx.append(j)
            pos, n_new = pos + take, n_new - take
        while n_new > 0:
            take = min(cs, n_new)
            cu.append(pos), seq_idx.append(j)
            pos, n_new = pos + take, n_new - take
        last.append(len(cu) - 1)
    return cu + [pos], seq_idx, last


def check_invariants(sc: Scenario, common, mamba) -> None:
    n, R, T, K = sc.n, sc.R, sc.T, 1 + sc.k
    q, seq, computed, prefilling = sc.q, sc.seq, sc.computed, sc.prefilling
    a = np.asarray

    # ---- counts add up
    nd, npf = int(mamba.num_decodes), int(mamba.num_prefills)
    assert nd + npf == n == int(common.num_reqs) == int(mamba.num_reqs)
    assert int(mamba.num_decode_tokens) == int(q[:nd].sum())
    assert int(mamba.num_decode_tokens) + int(mamba.num_prefill_tokens) == int(common.num_actual_tokens) == q.sum()
    assert list(a(mamba.distribution)) == [nd, n, R]
    attn_decodes = int(np.argmax(np.r_[q > 1 + sc.k, True]))  # leading rows with q <= threshold
    assert list(a(common.distribution)) == [attn_decodes, n, R]

    # ---- decodes precede prefills (rows are in vLLM's region order; Mamba's
    # decodes are the leading run of rows it can decode, seed-000 rows included)
    assert np.all(np.diff(batch_regions(q, computed, prefilling, 1 + sc.k)) >= 0)
    dthr = 1 + sc.k if sc.accepted is not None else 1
    drafts = sc.drafts if sc.drafts is not None else np.full(n, -1)
    stateful = prefilling & (computed > 0)
    can_decode = (q <= dthr) & (~prefilling | (stateful & ((q == 1) | (q == drafts + 1))))
    assert nd == int(np.argmax(np.r_[~can_decode, True]))

    # ---- common rows; padded rows never prefilling, empty, pointing nowhere (Rule 3, docs/architecture.md)
    assert list(a(np.diff(common.query_start_loc))) == list(q) + [0] * (R - n)
    assert list(a(common.seq_lens)) == list(seq) + [0] * (R - n)
    assert list(a(common.is_prefilling)) == list(prefilling) + [False] * (R - n)
    assert not a(common.block_table)[n:].any()
    assert (a(common.slot_mapping)[int(q.sum()) :] == PAD_SLOT_ID).all()
    assert int(common.max_seq_len) == (int(seq.max()) if n else 0)  # Rule 4
    assert int(common.max_query_len) == (int(q.max()) if n else 0)
    pos = np.concatenate([np.arange(c, c + n_new) for c, n_new in zip(computed, q)]) if n else np.zeros(0, int)
    rows = np.repeat(np.arange(n), q)
    assert np.array_equal(a(common.positions)[: pos.size], pos)
    assert np.array_equal(
        a(common.slot_mapping)[: pos.size], sc.attn_table[rows, pos // sc.attn_bs] * sc.attn_bs + pos % sc.attn_bs
    )

    # ---- every state index is a slot of the pool or PAD; padded rows are all PAD
    slots = [a(mamba.state_indices_decode), a(mamba.state_indices_decode_dst), a(mamba.state_indices_prefill),
             a(mamba.state_indices_prefill_initial), a(mamba.state_indices_chunk_checkpoint)]
    for s in slots:
        assert np.all((s == PAD_SLOT_ID) | ((s >= 0) & (s < sc.num_slots)))
    assert (a(mamba.state_indices_decode)[nd:] == PAD_SLOT_ID).all()
    assert (a(mamba.state_indices_decode_dst)[nd:] == PAD_SLOT_ID).all()
    assert (a(mamba.state_indices_prefill)[npf:] == PAD_SLOT_ID).all()
    assert (a(mamba.state_indices_prefill_initial)[npf:] == PAD_SLOT_ID).all()
    assert not a(mamba.has_initial_state)[npf:].any()
    assert (a(mamba.num_accepted_tokens)[nd:] == 1).all()

    # ---- decode windows (Rule 2): from the right block, K columns, real where used
    bs = sc.mamba_bs
    blk_lc = np.maximum(cdiv(computed, bs) - 1, 0)
    blk_ls = cdiv(seq, bs) - 1
    if sc.mode == "none":
        src_start = dst_start = np.zeros(n, dtype=np.int64)
    else:
        src_start, dst_start = blk_lc.copy(), blk_ls
        if sc.mode == "all" and sc.k > 0 and sc.prev is not None:
            src_start = np.where(sc.prev >= 0, sc.prev, blk_lc)
    acc = a(mamba.num_accepted_tokens)[:nd]
    for r in range(nd):
        assert list(a(mamba.state_indices_decode)[r]) == list(sc.state_table[r, src_start[r] : src_start[r] + K])
        assert list(a(mamba.state_indices_decode_dst)[r]) == list(sc.state_table[r, dst_start[r] : dst_start[r] + K])
        assert 1 <= acc[r] <= K and a(mamba.state_indices_decode)[r, acc[r] - 1] >= 1
        if prefilling[r]:
            assert acc[r] == 1
        elif sc.k > 0:
            assert acc[r] == (sc.accepted[r] if sc.accepted is not None else q[r])
    if sc.mode != "none":
        assert list(a(mamba.block_idx_last_computed_token)[:n]) == list(blk_lc)
        assert list(a(mamba.block_idx_last_scheduled_token)[:n]) == list(blk_ls)
        assert list(a(mamba.block_idx_first_scheduled_token)[:n]) == list(computed // bs)
    else:
        assert not a(mamba.block_idx_last_scheduled_token).any()

    # ---- prefill rows
    p_rows = np.arange(nd, n)
    assert list(a(mamba.state_indices_prefill)[:npf]) == list(sc.state_table[p_rows, dst_start[nd:]])
    assert list(a(mamba.has_initial_state)[:npf]) == list(computed[nd:] > 0)
    init = np.where(computed[nd:] > 0, sc.state_table[p_rows, 0 if sc.mode == "none" else blk_lc[nd:]], PAD_SLOT_ID)
    assert list(a(mamba.state_indices_prefill_initial)[:npf]) == list(init)
    qsl_p = a(mamba.query_start_loc_prefill)
    assert list(np.diff(qsl_p)) == list(q[nd:]) + [0] * (R - npf)

    # ---- SSD chunks: cover each prefill row exactly once, aligned from its first token
    NC = mamba.num_chunks_padded
    assert NC == num_chunks_for_bucket(T, R, sc.chunk_size)
    cu, seq_idx, last = a(mamba.cu_chunk_seqlens), a(mamba.seq_idx), a(mamba.last_chunk_indices)
    assert cu.shape == (NC + 1,) and seq_idx.shape == (NC,) and last.shape == (R,)
    ref_cu, ref_seq, ref_last = reference_chunks(computed[nd:], q[nd:], sc.chunk_size)
    nc = len(ref_seq)
    assert nc < NC and list(cu[: nc + 1]) == ref_cu and list(seq_idx[:nc]) == ref_seq
    assert list(last[:npf]) == ref_last and (last[npf:] == NC - 1).all()
    assert (cu[nc:] == int(mamba.num_prefill_tokens)).all() and (seq_idx[nc:] == R - 1).all()
    covered = np.zeros(int(q[nd:].sum()), dtype=int)
    for c in range(nc):
        j = seq_idx[c]
        lo, hi = cu[c], cu[c + 1]
        assert qsl_p[j] <= lo < hi <= qsl_p[j + 1]
        covered[lo:hi] += 1
        abs_lo, abs_hi = computed[nd + j] + lo - qsl_p[j], computed[nd + j] + hi - qsl_p[j]
        assert abs_lo // sc.chunk_size == (abs_hi - 1) // sc.chunk_size  # never crosses a chunk boundary
        if c != last[j]:
            assert abs_hi % sc.chunk_size == 0
            checkpoint = int(mamba.state_indices_chunk_checkpoint[c])
            if sc.mode != "none" and abs_hi % bs == 0:
                assert checkpoint == sc.state_table[nd + j, abs_hi // bs - 1]
            else:
                assert checkpoint == PAD_SLOT_ID
        else:
            assert hi == qsl_p[j + 1] and int(mamba.state_indices_chunk_checkpoint[c]) == PAD_SLOT_ID
    assert (covered == 1).all()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_batches_satisfy_metadata_invariants(sc):
    common, mamba = build(sc)
    check_invariants(sc, common, mamba)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 4), st.integers(0, 24))
def test_stale_rows_padding_and_packing_never_change_real_rows(sc, extra_reqs, extra_tokens):
    common, mamba = build(sc)
    # Rule 3 (docs/architecture.md): stale tails of the persistent buffers make no difference at all.
    clean_common, clean_mamba = build(sc, with_stale=False)
    assert leaves_equal(common, clean_common) and leaves_equal(mamba, clean_mamba)
    # Padding to a bigger bucket == building there directly, and keeps invariants.
    R2, T2 = sc.R + extra_reqs, sc.T + extra_tokens
    big_common, big_mamba = build(sc, R=R2, T=T2)
    assert leaves_equal(pad_to_bucket(common, (R2, T2)), big_common)
    assert leaves_equal(pad_to_bucket(mamba, (R2, T2)), big_mamba)
    sc.R, sc.T = R2, T2
    check_invariants(sc, big_common, big_mamba)
    # The packed buffer round-trips exactly.
    packed = pack(big_common, big_mamba)
    c2, m2 = unpack(packed.buffer, packed.layout)
    assert leaves_equal(c2, big_common) and leaves_equal(m2, big_mamba)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_slots_gathered_on_the_device_equal_the_builders(sc, rnd):
    """The engine packs the Mamba slot arrays apart and the step gathers them from the persistent state
    table (``metadata.device_slots``): through ``row_map``, from rows placed anywhere among other rows
    (garbage, the null row too), they equal the builder's, padding included, in every mode; and the
    builder reading that table through the same rows (``state_indices_rows``) builds the same metadata."""
    common, mamba = build(sc, with_stale=False)
    num_rows = sc.R + 1 + rnd.randint(0, 3)
    table = np.array([[rnd.randint(-5, 10**6) for _ in range(sc.state_table.shape[1])] for _ in range(num_rows)])
    row_map = np.zeros(sc.R, np.int32)  # padding rows read row 0
    row_map[: sc.n] = rnd.sample(range(1, num_rows), sc.n)
    table[row_map[: sc.n]] = sc.state_table
    # The host builder reads the same persistent table through the same rows (the engine's mirror).
    through_rows = build_mamba_metadata(
        common, state_indices=table, state_indices_rows=row_map[: sc.n], cache_mode=sc.mode, block_size=sc.mamba_bs,
        num_speculative_blocks=sc.k, num_accepted_tokens=sc.accepted, prev_step_last_block=sc.prev,
        chunk_size=sc.chunk_size, num_slots=sc.num_slots, num_decode_draft_tokens=sc.drafts)
    assert leaves_equal(through_rows, mamba)
    packed = pack(common, mamba, separate=DEVICE_SLOT_FIELDS)
    assert packed.layout.size == pack(common, mamba).layout.size - sum(
        np.asarray(getattr(mamba, name)).size for name in DEVICE_SLOT_FIELDS)
    _, apart = unpack(packed.buffer, packed.layout,
                      **{name: np.zeros(shape, np.int32) for name, shape in packed.layout.separate})
    gathered = jax.jit(gather_slot_indices)(apart, jnp.asarray(table, jnp.int32), jnp.asarray(row_map))
    for name in DEVICE_SLOT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(gathered, name)), getattr(mamba, name), err_msg=name)
    assert leaves_equal(jax.tree_util.tree_map(np.asarray, gathered), mamba)


# --------------------------------------------------------------------------- the host path's shortcuts
# The builders, ``pack`` and the classifiers take shortcuts for speed (a cached pack layout, unchecked
# classification cores, decode-only fast paths, int32 padding). These references are the plain-numpy
# formulations they replaced; the shortcuts must agree with them bit for bit.


def reference_pack_buffer(*metadatas, separate=()):
    """Every data leaf not in ``separate``, as int32 (bools 0/1), flattened, back to back in field order."""
    chunks = []
    for md in metadatas:
        for name in type(md).__dataclass_fields__:
            value = getattr(md, name)
            if name in separate or not isinstance(value, (np.ndarray, np.generic)):
                continue
            chunks.append(np.asarray(value).astype(np.int32).reshape(-1))
    return np.concatenate(chunks)


def reference_regions(q, computed, prefilling, threshold):
    has_context = computed > 0
    below = q <= threshold
    regions = np.full(q.shape[0], 0, dtype=np.int32)
    regions[has_context & below & prefilling] = 1
    regions[has_context & ~below] = 2
    regions[~has_context] = 3
    return regions


def reference_mamba_prefilling(prefilling, q, seq, drafts):
    stateful_prefill = prefilling & (seq > q)
    to_decode = stateful_prefill & (q == 1)
    if drafts is not None:
        to_decode = to_decode | (stateful_prefill & (drafts >= 0) & (q == drafts + 1))
    return prefilling & ~to_decode


def reference_reorder(q, prefilling, seq, threshold, drafts):
    regions = reference_regions(q, seq - q, prefilling, threshold).astype(np.int64)
    becomes_decode = prefilling & ~reference_mamba_prefilling(prefilling, q, seq, drafts)
    return np.argsort(regions * 2 + np.where(becomes_decode, 0, 1), kind="stable")


def reference_num_decodes(q, prefilling, threshold):
    """split_decodes_and_prefills(...)[0] as vLLM writes it (require_uniform=False)."""
    if q.size == 0:
        return 0
    if prefilling is None and q.max() <= threshold:
        return q.size
    if q[0] > threshold:
        return 0
    is_prefill = q > threshold
    if prefilling is not None:
        is_prefill = is_prefill | prefilling
    return int(np.argmax(is_prefill)) if is_prefill.any() else q.size


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_classifiers_match_their_plain_numpy_references(sc, rnd):
    # Shuffled, so reorder_batch has work to do (the scenario's rows come ordered).
    perm = list(range(sc.n))
    rnd.shuffle(perm)
    q, computed, prompt = sc.q[perm], sc.computed[perm], sc.prompt[perm]
    drafts = None if sc.drafts is None else sc.drafts[perm]
    prefilling, seq, thr = computed < prompt, computed + q, 1 + sc.k
    got = reorder_batch(q.astype(np.int32), prefilling, seq.astype(np.int32), decode_threshold=thr,
                        num_draft_tokens=drafts)
    assert got.dtype == np.int64 and np.array_equal(got, reference_reorder(q, prefilling, seq, thr, drafts))
    regions = batch_regions(q, computed, prefilling, thr)
    assert regions.dtype == np.int32 and np.array_equal(regions, reference_regions(q, computed, prefilling, thr))
    mp = mamba_is_prefilling(prefilling, q, seq, drafts)
    assert mp.dtype == bool and np.array_equal(mp, reference_mamba_prefilling(prefilling, q, seq, drafts))
    # The split, on the ordered rows (as the builders see them).
    oq, op = sc.q, sc.prefilling
    for short_extends_are_decodes in (True, False):
        nd = split_decodes_and_prefills(oq, op, thr, treat_short_extends_as_decodes=short_extends_are_decodes)
        assert nd[:2] == (reference_num_decodes(oq, None if short_extends_are_decodes else op, thr),
                          sc.n - nd[0])
        assert nd[2:] == (int(oq[: nd[0]].sum()), int(oq[nd[0]:].sum()))


def test_split_batch_is_the_runners_order_then_mambas_split():
    # Against the plain references: the order leaves drafts out (the runner's reorder), Mamba's split then counts
    # them (a prompt tail carrying its drafts).
    rng = np.random.default_rng(0)
    for _ in range(1500):
        n, k = int(rng.integers(0, 10)), int(rng.integers(0, 3))
        computed = rng.integers(0, 6, n) * rng.integers(0, 2, n)  # half the rows without context
        q = rng.integers(0, 2 + 2 * k, n) + rng.integers(0, 2, n) * rng.integers(0, 6, n)
        prompt = computed + rng.integers(-3, 4, n)
        drafts = np.minimum(rng.integers(0, k + 1, n), np.maximum(q - 1, 0)) if k else None
        thr = 1 + k
        split = classify.split_batch(computed, q, prompt, drafts, thr)
        prefilling, seq = computed < prompt, computed + q
        order = reference_reorder(q, prefilling, seq, thr, None)
        assert (split.order is None if np.array_equal(order, np.arange(n)) else np.array_equal(split.order, order))
        draft_counts = None if drafts is None else np.where(drafts > 0, drafts, -1)[order]
        mp = reference_mamba_prefilling(prefilling[order], q[order], seq[order], draft_counts)
        assert split.num_decodes == reference_num_decodes(q[order], mp, thr)
        assert split.decode_only == bool(np.all((q[order] <= thr) & (computed[order] > 0) & ~mp))



def test_split_rows_on_python_lists_is_split_batch_without_drafts():
    # The step loop's classification of a step without drafts (StepRows.of): the same order, decodes and
    # decode-only answer as the numpy split it stands in for, on batches with every region, Rule 1's one-token
    # rows, rows without context, done or still prefilling, empty ones and thresholds above 1.
    rng = np.random.default_rng(1)
    for _ in range(3000):
        n, thr = int(rng.integers(0, 12)), int(rng.integers(1, 4))
        computed = rng.integers(0, 6, n) * rng.integers(0, 2, n)
        q = rng.integers(0, 2 + thr, n) + rng.integers(0, 2, n) * rng.integers(0, 6, n)
        prompt = computed + rng.integers(-3, 4, n)
        want = classify.split_batch(computed, q, prompt, None, thr)
        got = classify.split_rows(computed.tolist(), q.tolist(), prompt.tolist(), thr)
        assert (got.order is None) == (want.order is None), (computed, q, prompt, thr)
        assert got.order is None or got.order == want.order.tolist()
        assert (got.num_decodes, got.decode_only, got.draft_counts) == (want.num_decodes, want.decode_only, None)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 4), st.integers(0, 24))
def test_pack_buffer_is_every_leaf_back_to_back(sc, extra_reqs, extra_tokens):
    """``pack`` caches its layout per signature: the buffer and layout must still be the leaves of this
    very batch (two buckets interleaved, so a stale layout would show), round-tripping exactly."""
    small = build(sc)
    big = build(sc, R=sc.R + extra_reqs, T=sc.T + extra_tokens)
    # Same bucket and meta, one more block-table column: only the leaf shapes tell the layouts apart.
    widened = dataclasses.replace(sc, attn_table=np.pad(sc.attn_table, ((0, 0), (0, 1))),
                                  stale={**sc.stale, "attn_table": np.pad(sc.stale["attn_table"], ((0, 0), (0, 1)))})
    wide = build(widened)
    for common, mamba in (small, big, wide, small, big, wide):
        for separate in ((), ("block_table",)):
            packed = pack(common, mamba, separate=separate)
            expect = reference_pack_buffer(common, mamba, separate=separate)
            assert packed.buffer.dtype == np.int32 and np.array_equal(packed.buffer, expect)
            assert packed.layout.size == expect.size
            offset = 0
            for _, _, slots in packed.layout.entries:  # offsets and sizes laid out back to back
                for slot in slots:
                    assert slot.offset == offset and slot.size == int(np.prod(slot.shape))
                    offset += slot.size
            parts = {name: packed.separate[name] for name in separate}
            c2, m2 = unpack(packed.buffer, packed.layout, **parts)
            assert leaves_equal(c2, common) and leaves_equal(m2, mamba)
