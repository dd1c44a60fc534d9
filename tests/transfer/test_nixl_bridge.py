"""Real NIXL (UCX) READs between two OS processes on loopback, checked byte-exactly.

The prefill engine is ``transfer.pages.synthetic_prefill_main`` in a spawned process (one NIXL
agent per P rank, pages on their own anonymous mappings); this pytest process is the decode
engine (one ``PageImporter`` per D rank). Metadata and page directories travel over a
multiprocessing Pipe. Expected D pages come from ``transfer.pages`` (independent of the plan).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest

from jaxmamba.errors import SlotError, TransferError
from transfer.hetero_tp import TransferPlan, TransferShape
from transfer.nixl_bridge import (
    PageDirectory,
    PageExporter,
    PageImporter,
    ReadFailed,
    RequestPages,
    live_registrations,
    nixl_available,
)
from transfer.pages import layer_state, shard_kv, shard_mamba_pages, synthetic_prefill_main

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not importable (install the 'nixl' extra)"),
]

SENTINEL = 0xAB
NUM_SLOTS, NUM_BLOCKS = 5, 4
MAMBA_LAYERS, KV_LAYERS = ["layers.0.mixer", "layers.2.mixer"], ["layers.1.attn"]
# Remote slot -> local slot (slot 0 is the null slot on both sides); remote block -> local block.
MAMBA_PAIRS = [(1, 3), (2, 1), (4, 2)]
KV_PAIRS = [(2, 1), (3, 3), (1, 2)]
D_PAD = 48


def _shape(**kw) -> TransferShape:
    base = dict(
        intermediate_size=16 * 3,
        n_groups=1,
        d_state=5,
        num_heads=16,
        head_dim=3,
        conv_kernel=4,
        num_spec=0,
        conv_dtype_size=2,
        ssm_dtype_size=4,
        num_kv_heads=2,
        attn_head_dim=4,
        kv_dtype_size=2,
        block_size=4,
        kv_layout="NHD",
    )
    base.update(kw)
    return TransferShape(**base)


def _spec(shape: TransferShape, p_tp: int, *, seed: int, engine_id: str, env=None) -> dict:
    return dict(
        shape=dataclasses.asdict(shape),
        p_tp=p_tp,
        num_slots=NUM_SLOTS,
        num_blocks=NUM_BLOCKS,
        seed=seed,
        mamba_layers=MAMBA_LAYERS,
        kv_layers=KV_LAYERS,
        p_pad=24,
        engine_id=engine_id,
        env=env or {},
    )


@contextmanager
def prefill_process(spec: dict):
    """Spawn the synthetic P engine; yield (process, pipe, [PageDirectory per P rank])."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=synthetic_prefill_main, args=(child, spec), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(60):
            raise AssertionError("the prefill process did not publish its directories")
        tag, dirs = parent.recv()
        assert tag == "dirs"
        yield proc, parent, [PageDirectory.from_bytes(d) for d in dirs]
    finally:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGCONT)
                parent.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


class DecodeRank:
    """One D rank: sentinel-filled destination pages registered with a PageImporter."""

    def __init__(self, plan: TransferPlan, name: str, *, split: bool = False) -> None:
        """``split``: conv and SSM state in two arrays per layer (jaxmamba.cache's form) instead of
        vLLM's padded unified page."""
        self.plan, self.split = plan, split
        shape, d = plan.shape, plan.d_mamba
        if split:
            self.mamba = {
                l: (
                    np.full((NUM_SLOTS, d.conv_bytes), SENTINEL, np.uint8),
                    np.full((NUM_SLOTS, d.ssm_bytes), SENTINEL, np.uint8),
                )
                for l in MAMBA_LAYERS
            }
        else:
            self.mamba = {l: np.full((NUM_SLOTS, d.page_bytes + D_PAD), SENTINEL, np.uint8) for l in MAMBA_LAYERS}
        self.kv = {}
        for j, layer in enumerate(KV_LAYERS):
            _, state = layer_state(
                {"shape": dataclasses.asdict(shape), "num_slots": NUM_SLOTS, "num_blocks": NUM_BLOCKS, "seed": 0},
                1000 + j,
            )
            like = shard_kv(shape, state, plan.d_tp, plan.d_rank)
            self.kv[layer] = np.full(like.nbytes, SENTINEL, np.uint8).view(like.dtype).reshape(like.shape)
        self.importer = PageImporter(name, plan)
        for layer, pages in self.mamba.items():
            if split:
                self.importer.register_mamba_layer(layer, conv=pages[0], ssm=pages[1])
            else:
                self.importer.register_mamba_layer(layer, pages, conv_bytes=d.conv_bytes, ssm_bytes=d.ssm_bytes)
        for layer, kv in self.kv.items():
            self.importer.register_kv_layer(layer, kv, kv_layout=shape.kv_layout)

    def arrays(self) -> list[np.ndarray]:
        mamba = [a for v in self.mamba.values() for a in (v if self.split else (v,))]
        return mamba + list(self.kv.values())

    def untouched(self) -> bool:
        return all((a.view(np.uint8) == SENTINEL).all() for a in self.arrays())

    def expected(self, spec: dict, mamba_pairs, kv_pairs) -> dict[str, np.ndarray]:
        """Destination arrays as they must be after the read: sentinel except the read pages."""
        plan, out = self.plan, {}
        for i, layer in enumerate(MAMBA_LAYERS):
            shape, state = layer_state(spec, i)
            mine = shard_mamba_pages(
                shape, state, plan.d_tp, plan.d_rank, page_stride=plan.d_mamba.page_bytes + D_PAD, pad_byte=SENTINEL
            )
            want = np.full_like(mine, SENTINEL)
            for src, dst in mamba_pairs:
                want[dst] = mine[src]
            out[layer] = want
        for j, layer in enumerate(KV_LAYERS):
            shape, state = layer_state(spec, 1000 + j)
            mine = shard_kv(shape, state, plan.d_tp, plan.d_rank)
            want = np.full_like(self.kv[layer], 0)
            want.view(np.uint8)[...] = SENTINEL
            for src, dst in kv_pairs:
                want[:, dst] = mine[:, src]
            out[layer] = want
        return out

    def check(self, spec, mamba_pairs, kv_pairs) -> None:
        want = self.expected(spec, mamba_pairs, kv_pairs)
        cb, pb = self.plan.d_mamba.conv_bytes, self.plan.d_mamba.page_bytes
        for layer in MAMBA_LAYERS:
            msg = f"{layer} d_rank={self.plan.d_rank}"
            if self.split:
                np.testing.assert_array_equal(self.mamba[layer][0], want[layer][:, :cb], err_msg=msg)
                np.testing.assert_array_equal(self.mamba[layer][1], want[layer][:, cb:pb], err_msg=msg)
            else:
                np.testing.assert_array_equal(self.mamba[layer], want[layer], err_msg=msg)
        for layer in KV_LAYERS:
            np.testing.assert_array_equal(self.kv[layer], want[layer], err_msg=f"{layer} d_rank={self.plan.d_rank}")

    def close(self) -> None:
        bufs = self.importer.registered_buffers()
        assert bufs and all(self.importer.holds_registration(b) for b in bufs)
        self.importer.close(verify=True)  # asks the agent that every region is gone


def _poll_notifs(conn, want: dict[int, set[str]], timeout: float = 10.0) -> dict[int, dict[str, list[bytes]]]:
    got: dict[int, dict[str, list[bytes]]] = {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        conn.send(("notifs",))
        for rank, per_agent in conn.recv().items():
            for agent, msgs in per_agent.items():
                got.setdefault(rank, {}).setdefault(agent, []).extend(msgs)
        if all(set(got.get(r, {})) >= agents for r, agents in want.items()):
            break
        time.sleep(0.01)
    return got


@pytest.mark.parametrize(
    "p_tp,d_tp,shape_kw,split",
    [
        # 3-read slices; replicated group; head slices (NHD); D keeps conv/ssm in two arrays
        (1, 2, dict(n_groups=1, num_kv_heads=2), True),
        # gather; GQA dedup (P replicates KV heads)
        (4, 2, dict(n_groups=4, num_kv_heads=2, kv_layout="HND", num_spec=2, conv_dtype_size=4), False),
        (2, 1, dict(n_groups=1, num_kv_heads=8), False),  # gather with a replicated group on P
        (2, 2, dict(n_groups=2, num_kv_heads=4), True),  # equal TP, unified P page -> split D arrays
    ],
    ids=["P1D2", "P4D2", "P2D1", "P2D2"],
)
def test_two_process_reads_rebuild_d_pages(p_tp, d_tp, shape_kw, split):
    shape = _shape(**shape_kw)
    spec = _spec(shape, p_tp, seed=11 * p_tp + d_tp, engine_id=f"prefill-{p_tp}-{d_tp}")
    base_regs = live_registrations()
    with prefill_process(spec) as (proc, conn, dirs):
        ranks = [
            DecodeRank(TransferPlan(shape, p_tp, d_tp, d), f"decode-{p_tp}-{d_tp}-r{d}", split=split)
            for d in range(d_tp)
        ]
        for r in ranks:
            r.importer.connect(dirs)
            assert r.importer.connected_ranks == r.plan.read_targets
        # What P's scheduler hands to D for the request: its page ids per layer.
        request = RequestPages.from_bytes(
            RequestPages(
                "req-7",
                mamba={l: tuple(s for s, _ in MAMBA_PAIRS) for l in MAMBA_LAYERS},
                kv={l: tuple(b for b, _ in KV_PAIRS) for l in KV_LAYERS},
            ).to_bytes()
        )
        for r in ranks:
            res = r.importer.read_request(
                request,
                mamba_slots=[d for _, d in MAMBA_PAIRS],
                kv_blocks={KV_LAYERS[0]: [d for _, d in KV_PAIRS]},
                timeout_s=20,
            )
            assert res.bytes_read == (
                len(MAMBA_LAYERS) * len(MAMBA_PAIRS) * r.plan.bytes_per_slot()
                + len(KV_LAYERS) * len(KV_PAIRS) * r.plan.bytes_per_block()
            )
            assert set(res.bytes_per_rank) == set(r.plan.read_targets)
            r.check(spec, MAMBA_PAIRS, KV_PAIRS)
        # Every P rank hears "req-7" from every D agent that read from it (so it may free pages).
        want = {p: {r.importer.name for r in ranks if p in r.plan.read_targets} for p in range(p_tp)}
        got = _poll_notifs(conn, want)
        for p, agents in want.items():
            assert set(got.get(p, {})) == agents
            assert all(msgs == [b"req-7"] for msgs in got[p].values())
        for r in ranks:
            r.close()
        assert live_registrations() == base_regs
        conn.send(("close",))
        assert conn.recv() == ("closed", 0)


def test_dead_peer_fails_cleanly_and_reconnect_is_required():
    shape = _shape(n_groups=2, num_kv_heads=2)
    spec = _spec(shape, 2, seed=5, engine_id="prefill-dead")
    with prefill_process(spec) as (proc, conn, dirs):
        r = DecodeRank(TransferPlan(shape, 2, 1, 0), "decode-dead")
        r.importer.connect(dirs)
        # Bad pages are refused before anything is posted.
        for kw, match in [
            (dict(mamba=[(0, 1)]), "null slot"),
            (dict(mamba=[(1, 1), (2, 1)]), "alias"),
            (dict(mamba=[(NUM_SLOTS, 1)]), "out of range"),
            (dict(mamba=[(1, -1)]), "PAD_SLOT_ID"),
            (dict(kv=[(NUM_BLOCKS, 1)]), "out of range"),
            (dict(kv=[(1, 0)]), "null slot/block"),
            (dict(mamba={"layers.9.mixer": [(1, 1)]}), "no local mamba layer"),
        ]:
            with pytest.raises((SlotError, TransferError), match=match):
                r.importer.read(timeout_s=5, **kw)
        with pytest.raises(TransferError, match="2 remote pages but 1 local"):
            r.importer.read_request(RequestPages("req-1", kv={KV_LAYERS[0]: (1, 2)}), kv_blocks=[3])
        assert r.untouched()
        proc.kill()
        proc.join(10)
        with pytest.raises(ReadFailed) as err:
            r.importer.read(mamba=MAMBA_PAIRS, kv=KV_PAIRS, timeout_s=5)
        e = err.value
        assert isinstance(e, TransferError) and "P rank" in str(e)
        assert e.failed_ranks and not set(e.failed_ranks) & set(r.importer.connected_ranks)
        if e.may_have_written:
            assert e.invalid_slots == {l: sorted(d for _, d in MAMBA_PAIRS) for l in MAMBA_LAYERS}
            assert e.invalid_blocks == {l: sorted(d for _, d in KV_PAIRS) for l in KV_LAYERS}
        else:
            assert e.invalid_slots == {} and e.invalid_blocks == {}
        assert r.untouched()  # nothing came from a dead peer
        # The failed peer was dropped: the next read fails fast, before posting.
        with pytest.raises(TransferError, match="not connected"):
            r.importer.read(mamba=MAMBA_PAIRS, timeout_s=5)
        base = live_registrations()
        r.close()
        assert live_registrations() == base - 3  # 2 mamba layers + 1 attention layer


def test_read_timeout_marks_pages_invalid():
    """P is frozen (SIGSTOP): the READ with a completion notification cannot complete."""
    shape = _shape(n_groups=2, num_kv_heads=2)
    spec = _spec(shape, 1, seed=6, engine_id="prefill-stopped")
    with prefill_process(spec) as (proc, conn, dirs):
        r = DecodeRank(TransferPlan(shape, 1, 2, 1), "decode-timeout")
        r.importer.connect(dirs)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            with pytest.raises(ReadFailed, match="did not complete within 0.5 s") as err:
                r.importer.read(mamba=MAMBA_PAIRS, kv=KV_PAIRS, timeout_s=0.5, notif=b"req-9")
            assert time.perf_counter() - t0 < 5
            e = err.value
            assert e.may_have_written and e.failed_ranks == (0,)
            assert e.invalid_slots == {l: sorted(d for _, d in MAMBA_PAIRS) for l in MAMBA_LAYERS}
            assert e.invalid_blocks == {l: sorted(d for _, d in KV_PAIRS) for l in KV_LAYERS}
            # Whatever the cancelled READ did, pages it did not target are untouched.
            dst_slots = {d for _, d in MAMBA_PAIRS}
            for pages in r.mamba.values():
                for s in range(NUM_SLOTS):
                    if s not in dst_slots:
                        assert (pages[s] == SENTINEL).all()
            dst_blocks = {d for _, d in KV_PAIRS}
            for kv in r.kv.values():
                for b in range(NUM_BLOCKS):
                    if b not in dst_blocks:
                        assert (kv[:, b].view(np.uint8) == SENTINEL).all()
            assert r.importer.connected_ranks == ()
            # The peer recovers: after a fresh connect the same read completes byte-exactly.
            os.kill(proc.pid, signal.SIGCONT)
            r.importer.connect(dirs)
            r.importer.read(mamba=MAMBA_PAIRS, kv=KV_PAIRS, timeout_s=20, notif=b"req-9b")
            r.check(spec, MAMBA_PAIRS, KV_PAIRS)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        r.close()


def test_page_size_mismatch_is_refused_before_any_read():
    # The P engine runs with speculative decoding (2 more conv rows): its pages are larger.
    p_shape = _shape(n_groups=2, num_kv_heads=2, num_spec=2)
    d_shape = _shape(n_groups=2, num_kv_heads=2, num_spec=0)
    spec = _spec(p_shape, 2, seed=8, engine_id="prefill-mismatch")
    base = live_registrations()
    with prefill_process(spec) as (proc, conn, dirs):
        r = DecodeRank(TransferPlan(d_shape, 2, 2, 1), "decode-mismatch")
        with pytest.raises(TransferError, match="page size mismatch"):
            r.importer.connect(dirs)
        assert r.importer.connected_ranks == ()
        with pytest.raises(TransferError, match="not connected"):
            r.importer.read(mamba=MAMBA_PAIRS, timeout_s=5)
        # A plan for another P TP is refused too (the directory says TP=2).
        other = PageImporter("decode-mismatch-tp", TransferPlan(d_shape, 1, 2, 1))
        with pytest.raises(TransferError, match="TP=2"):
            other.connect(dirs)
        other.close(verify=True)
        # So is a KV block of another layout.
        hnd = PageImporter("decode-mismatch-kv", TransferPlan(dataclasses.replace(p_shape, kv_layout="HND"), 2, 2, 1))
        kv = np.zeros((2, NUM_BLOCKS, 1, 4, 4), np.uint16)
        hnd.register_kv_layer(KV_LAYERS[0], kv, kv_layout="HND")
        with pytest.raises(TransferError, match="kv_layout='NHD'"):
            hnd.connect(dirs)
        hnd.close(verify=True)
        assert r.untouched()
        r.close()
    assert live_registrations() == base


def test_failed_read_from_unmapped_pages():
    """P deregistered and unmapped its pages after publishing them: the READ errors out."""
    shape = _shape(n_groups=1, num_kv_heads=1)
    spec = _spec(shape, 1, seed=9, engine_id="prefill-unmapped")
    with prefill_process(spec) as (proc, conn, dirs):
        r = DecodeRank(TransferPlan(shape, 1, 1, 0), "decode-unmapped")
        r.importer.connect(dirs)
        conn.send(("unmap",))
        assert conn.recv() == "unmapped"
        with pytest.raises(ReadFailed) as err:
            r.importer.read(mamba=MAMBA_PAIRS, kv=KV_PAIRS, timeout_s=5)
        assert err.value.failed_ranks == (0,)
        assert r.untouched()
        r.close()
        conn.send(("close",))
        assert conn.recv() == ("closed", 0)


def test_jax_cpu_arrays_as_source_pages():
    """A P engine whose caches are JAX arrays in jaxmamba.cache's form (separate conv and ssm
    arrays per layer) exports them by ``unsafe_buffer_pointer()``; D reads into vLLM-form pages."""
    jnp = pytest.importorskip("jax.numpy")
    shape = _shape(n_groups=2, num_kv_heads=2)
    spec = _spec(shape, 1, seed=4, engine_id="prefill-jax")
    plan = TransferPlan(shape, 1, 2, 0)
    _, state = layer_state(spec, 0)
    _, kstate = layer_state(spec, 1000)
    # P TP=1 holds the full state: conv (slots, conv_dim, R), ssm (slots, H, P, N), kv (2, blocks, bs, K, hd).
    p_conv, p_ssm, p_kv = jnp.asarray(state.conv), jnp.asarray(state.ssm), jnp.asarray(shard_kv(shape, kstate, 1, 0))
    base = live_registrations()
    exp = PageExporter("jax-p0", engine_id="prefill-jax", tp_size=1, rank=0)
    region = exp.register_mamba_layer(MAMBA_LAYERS[0], conv=p_conv, ssm=p_ssm)
    assert not region.unified and (region.conv_bytes, region.ssm_bytes) == (
        plan.p_mamba.conv_bytes,
        plan.p_mamba.ssm_bytes,
    )
    exp.register_kv_layer(KV_LAYERS[0], p_kv)
    imp = PageImporter("jax-d0", plan)
    dst = np.full((NUM_SLOTS, plan.d_mamba.page_bytes), SENTINEL, np.uint8)
    imp.register_mamba_layer(MAMBA_LAYERS[0], dst, conv_bytes=plan.d_mamba.conv_bytes, ssm_bytes=plan.d_mamba.ssm_bytes)
    want_kv = shard_kv(shape, kstate, 2, 0)
    dkv = np.zeros_like(want_kv)
    imp.register_kv_layer(KV_LAYERS[0], dkv)
    imp.connect([exp.directory().to_bytes()])
    imp.read(mamba=[(2, 1)], kv=[(1, 2)], timeout_s=10)
    np.testing.assert_array_equal(dst[1], shard_mamba_pages(shape, state, 2, 0)[2])
    assert (dst[[0, 2, 3, 4]] == SENTINEL).all()
    np.testing.assert_array_equal(dkv[:, 2], want_kv[:, 1])
    assert not dkv[:, [0, 1, 3]].any()
    imp.close(verify=True)
    exp.close(verify=True)
    assert live_registrations() == base
