"""The page-level flow of ``python -m jaxmamba.bench transfer`` (its docstring says what is measured): the
request ``Workload``, one ``DecodeRank`` (a ``PageImporter`` and its destination pages) per D rank, the spawned
``PrefillProcess``, and ``run_ratio`` (timed passes, then every page verified) for one P_TP/D_TP ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

SENTINEL = 0xAB


@dataclasses.dataclass(frozen=True)
class Workload:
    """Layers, page counts and page ids on both engines for ``num_requests`` prompts."""

    mamba_layers: tuple[str, ...]
    kv_layers: tuple[str, ...]
    num_requests: int
    blocks_per_request: int
    p_slots: tuple[int, ...]  # P slot of request i (the same id on every Mamba layer and P rank)
    d_slots: tuple[int, ...]  # D slot of request i
    p_blocks: tuple[tuple[int, ...], ...]  # P block ids of request i, in token order
    d_blocks: tuple[tuple[int, ...], ...]

    @property
    def num_slots(self) -> int:  # slot 0 is the null slot on both engines
        return self.num_requests + 1

    @property
    def num_blocks(self) -> int:  # block 0 is the null block
        return self.num_requests * self.blocks_per_request + 1

    @classmethod
    def build(cls, cfg: Any, num_requests: int, prompt_len: int, block_size: int, seed: int) -> "Workload":
        mamba = tuple(f"layers.{i}.mixer" for i in cfg.mamba_layer_ids)
        kv = tuple(f"layers.{i}.attn" for i in cfg.attention_layer_ids)
        nb = math.ceil(prompt_len / block_size) if kv else 0
        n = num_requests
        # P allocates in order; D hands out slots in reverse and blocks in a seeded shuffle, so
        # a READ that ignored the page pairing would land on the wrong page.
        d_perm = np.random.default_rng(seed).permutation(np.arange(1, n * nb + 1)) if nb else np.zeros(0, int)
        return cls(
            mamba,
            kv,
            n,
            nb,
            tuple(range(1, n + 1)),
            tuple(range(n, 0, -1)),
            tuple(tuple(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(n)),
            tuple(tuple(int(b) for b in d_perm[i * nb : (i + 1) * nb]) for i in range(n)),
        )


# ---- one D rank -----------------------------------------------------------------------------------


class DecodeRank:
    """One decode rank: sentinel-filled destination pages registered with a ``PageImporter``.

    ``d_pages="jaxmamba"``: per Mamba layer a conv array ``(slots, conv_dim_local, R)`` and an SSM
    array ``(slots, H_local, P, N)`` (jaxmamba.cache's form); ``"vllm"``: one unified page per slot
    (conv then SSM, vLLM's ``MambaSpec`` page). KV: ``(2, blocks, ...)`` per attention layer in the
    plan's KV layout. Element types are unsigned stand-ins of the dtype widths (bytes are bytes).
    """

    def __init__(self, plan: Any, name: str, work: Workload, d_pages: str) -> None:
        from jaxmamba.layout import kv_cache_shape, mamba2_state_shape
        from transfer.nixl_bridge import PageImporter
        from transfer.pages import uint_dtype

        self.plan, self.work, self.d_pages = plan, work, d_pages
        s, d = plan.shape, plan.d_mamba
        conv_shape, ssm_shape = mamba2_state_shape(
            plan.d_tp, s.intermediate_size, s.n_groups, s.num_heads, s.head_dim, s.d_state, s.conv_kernel,
            num_spec=s.num_spec,
        )
        slots = work.num_slots
        self.mamba: dict[str, tuple[np.ndarray, ...]] = {}
        for layer in work.mamba_layers:
            if d_pages == "jaxmamba":
                self.mamba[layer] = (
                    np.empty((slots, *conv_shape), uint_dtype(s.conv_dtype_size)),
                    np.empty((slots, *ssm_shape), uint_dtype(s.ssm_dtype_size)),
                )
            else:
                self.mamba[layer] = (np.empty((slots, d.page_bytes), np.uint8),)
        self.kv: dict[str, np.ndarray] = {}
        for layer in work.kv_layers:
            two, nb, bs, heads, hd = kv_cache_shape(work.num_blocks, s.block_size, s.num_kv_heads, s.attn_head_dim,
                                                    plan.d_tp)
            shape = (two, nb, bs, heads, hd) if s.kv_layout == "NHD" else (two, nb, heads, bs, hd)
            self.kv[layer] = np.empty(shape, uint_dtype(s.kv_dtype_size))
        self.reset()
        self.importer = PageImporter(name, plan)
        try:
            for layer, arrays in self.mamba.items():
                if d_pages == "jaxmamba":
                    self.importer.register_mamba_layer(layer, conv=arrays[0], ssm=arrays[1])
                else:
                    self.importer.register_mamba_layer(layer, arrays[0], conv_bytes=d.conv_bytes,
                                                       ssm_bytes=d.ssm_bytes)
            for layer, kv in self.kv.items():
                self.importer.register_kv_layer(layer, kv, kv_layout=s.kv_layout)
        except Exception:
            self.importer.close()
            raise

    def reset(self) -> None:
        for arrays in self.mamba.values():
            for a in arrays:
                a.view(np.uint8)[...] = SENTINEL
        for kv in self.kv.values():
            kv.view(np.uint8)[...] = SENTINEL

    def mamba_page_bytes(self, layer: str) -> np.ndarray:
        """``(slots, page_bytes)`` uint8: this rank's pages of ``layer`` as one byte page per slot."""
        arrays = self.mamba[layer]
        return np.concatenate([a.view(np.uint8).reshape(a.shape[0], -1) for a in arrays], axis=1)

    def verify(self, mamba_states: list, kv_states: list) -> str:
        """"" if every destination byte is what this rank's own sharding holds, else the first problem."""
        from transfer.pages import shard_kv, shard_mamba_pages

        plan, work = self.plan, self.work
        who = f"D rank {plan.d_rank}/{plan.d_tp}"
        for layer, (shape, state) in zip(work.mamba_layers, mamba_states, strict=True):
            mine = shard_mamba_pages(shape, state, plan.d_tp, plan.d_rank)  # indexed by P slot
            want = np.full((work.num_slots, mine.shape[1]), SENTINEL, np.uint8)
            want[list(work.d_slots)] = mine[list(work.p_slots)]
            got = self.mamba_page_bytes(layer)
            if got.shape != want.shape:
                return f"{who} {layer}: page is {got.shape[1]} bytes, its sharding gives {want.shape[1]}"
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                return f"{who} {layer}: {len(bad)} bytes differ (first: slot {bad[0][0]}, byte {bad[0][1]})"
        d_blocks = [b for blocks in work.d_blocks for b in blocks]
        p_blocks = [b for blocks in work.p_blocks for b in blocks]
        for layer, (shape, state) in zip(work.kv_layers, kv_states, strict=True):
            mine = shard_kv(shape, state, plan.d_tp, plan.d_rank)  # indexed by P block
            want = np.empty_like(self.kv[layer])
            want.view(np.uint8)[...] = SENTINEL
            want[:, d_blocks] = mine[:, p_blocks]
            got = self.kv[layer]
            if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                bad = np.argwhere(got != want) if got.shape == want.shape else [("shape",)]
                return f"{who} {layer}: {len(bad)} elements differ (first at {tuple(int(i) for i in bad[0])})"
        return ""

    def close(self) -> None:
        self.importer.close()


# ---- one prefill engine process -----------------------------------------------------------------


class PrefillProcess:
    """``synthetic_prefill_main`` in a spawned process, serving P_TP ranks' pages."""

    def __init__(self, spec: dict, timeout_s: float) -> None:
        from transfer.nixl_bridge import PageDirectory
        from transfer.pages import synthetic_prefill_main

        ctx = mp.get_context("spawn")  # never fork a process that holds NIXL/UCX threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=synthetic_prefill_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        try:
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the prefill process (P_TP={spec['p_tp']}) did not publish its pages "
                                   f"within {timeout_s:g} s")
            try:
                tag, dirs = self.conn.recv()
            except EOFError:
                raise RuntimeError(f"the prefill process (P_TP={spec['p_tp']}) exited before publishing its pages "
                                   f"(exit code {self.proc.exitcode}; its traceback is above)") from None
            if tag != "dirs":
                raise RuntimeError(f"the prefill process answered {tag!r} instead of its directories")
            self.directories = [PageDirectory.from_bytes(d) for d in dirs]
        except BaseException:
            self.shutdown()
            raise

    def idle_cpu_cores(self, window_s: float = 0.3) -> float | None:
        """CPU (cores) the process uses while it only waits for commands (NIXL progress threads)."""
        return _idle_cpu_cores(self.proc.pid, window_s)

    def notifications(self) -> dict[int, dict[str, list[bytes]]]:
        self.conn.send(("notifs",))
        return self.conn.recv()

    def shutdown(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _idle_cpu_cores(pid: int, window_s: float) -> float | None:
    """CPU cores process ``pid`` burns over ``window_s`` (for this process: while it sleeps)."""
    c0, t0 = _cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)
    c1, t1 = _cpu_seconds(pid), time.monotonic()
    return None if c0 is None or c1 is None else (c1 - c0) / (t1 - t0)


def _poll_notifs(prefill: PrefillProcess, want: dict[int, dict[str, set[bytes]]], timeout_s: float = 10.0) -> str:
    """"" once every P rank has every expected notification from every expected D agent."""
    got: dict[int, dict[str, set[bytes]]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for rank, per_agent in prefill.notifications().items():
            for agent, msgs in per_agent.items():
                got.setdefault(int(rank), {}).setdefault(agent, set()).update(msgs)
        missing = [(p, a) for p, agents in want.items() for a, msgs in agents.items()
                   if not msgs <= got.get(p, {}).get(a, set())]
        if not missing:
            return ""
        if time.monotonic() > deadline:
            p, a = missing[0]
            return f"P rank {p} lacks {len(want[p][a] - got.get(p, {}).get(a, set()))} notification(s) from {a}"
        time.sleep(0.01)


# ---- one ratio ------------------------------------------------------------------------------------


def _timed_passes(ranks: list[DecodeRank], requests: list, args: argparse.Namespace):
    """``args.repeats`` passes of every request's READ on every D rank: ``(seconds per pass, the notifications each
    importer sent, the last pass's read results)``."""
    from transfer.nixl_bridge import RequestPages

    pass_s: list[float] = []
    sent: dict[str, set[bytes]] = {r.importer.name: set() for r in ranks}
    results = []
    for rep in range(args.repeats):
        for r in ranks:
            r.reset()
        results = []
        t0 = time.perf_counter()
        for i, (remote, slots, blocks) in enumerate(requests):
            pages = RequestPages(f"req{i}-pass{rep}", **remote)
            for r in ranks:
                results.append(r.importer.read_request(pages, mamba_slots=slots, kv_blocks=blocks,
                                                       timeout_s=args.timeout))
        pass_s.append(time.perf_counter() - t0)
        for r in ranks:
            sent[r.importer.name] |= {f"req{i}-pass{rep}".encode() for i in range(len(requests))}
    return pass_s, sent, results


def _verify_ratio(prefill: PrefillProcess, spec: dict, work: Workload, ranks: list[DecodeRank],
                  sent: dict[str, set[bytes]], measured: int, expected: int) -> list[str]:
    """What went wrong, checked in order: the bytes read, the notifications delivered, every destination byte."""
    from transfer.pages import layer_state

    problems = []
    if measured != expected:
        problems.append(f"the bridge read {measured} bytes, the plans say {expected}")
    want_notifs: dict[int, dict[str, set[bytes]]] = {}
    for r in ranks:
        for p in r.plan.read_targets:
            want_notifs.setdefault(p, {})[r.importer.name] = sent[r.importer.name]
    problem = _poll_notifs(prefill, want_notifs)
    if problem:
        problems.append(problem)
    mamba_states = [layer_state(spec, i) for i in range(len(work.mamba_layers))]
    kv_states = [layer_state(spec, 1000 + j) for j in range(len(work.kv_layers))]
    for r in ranks:
        problem = r.verify(mamba_states, kv_states)
        if problem:
            problems.append(problem)
    return problems


def run_ratio(prefill: PrefillProcess, spec: dict, shape: Any, work: Workload, p_tp: int, d_tp: int,
              args: argparse.Namespace) -> dict:
    from transfer.hetero_tp import TransferPlan, signed_tp_ratio

    plans = [TransferPlan(shape, p_tp, d_tp, r) for r in range(d_tp)]
    ranks: list[DecodeRank] = []
    row: dict[str, Any] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, tp_ratio=signed_tp_ratio(p_tp, d_tp))
    try:
        for plan in plans:
            ranks.append(DecodeRank(plan, f"bench-{spec['engine_id']}-d{d_tp}-r{plan.d_rank}", work, args.d_pages))
        for r in ranks:
            r.importer.connect(prefill.directories)
        row["d_idle_cpu_cores"] = _idle_cpu_cores(os.getpid(), 0.3)
        row["p_idle_cpu_cores"] = prefill.idle_cpu_cores()
        requests = []
        for i in range(work.num_requests):
            requests.append((
                dict(mamba={l: (work.p_slots[i],) for l in work.mamba_layers},
                     kv={l: work.p_blocks[i] for l in work.kv_layers}),
                [work.d_slots[i]],
                list(work.d_blocks[i]),
            ))
        pass_s, sent, results = _timed_passes(ranks, requests, args)
        n = work.num_requests
        measured = sum(res.bytes_read for res in results)
        mamba_b = sum(len(work.mamba_layers) * p.bytes_per_slot() for p in plans)
        kv_b = sum(len(work.kv_layers) * work.blocks_per_request * p.bytes_per_block() for p in plans)
        warm = pass_s[1:] or pass_s
        wall = statistics.median(warm)
        row.update(
            d_ranks=d_tp,
            sources_per_d_rank=max(len(p.read_targets) for p in plans),
            mamba_bytes_per_request=mamba_b,
            kv_bytes_per_request=kv_b,
            bytes_per_request=mamba_b + kv_b,
            measured_bytes_per_request=measured // n if measured % n == 0 else measured / n,
            descriptors_per_request=sum(res.num_descriptors for res in results) / n,
            reads_per_pass=len(results),
            cold_wall_s=pass_s[0],
            wall_s=wall,
            pass_wall_s=pass_s,
            ms_per_request=1e3 * wall / n,
            gb_per_s=measured / wall / 1e9,
        )
        problems = _verify_ratio(prefill, spec, work, ranks, sent, measured, n * (mamba_b + kv_b))
        row["verified"] = not problems
        row["problems"] = problems
    finally:
        for r in ranks:
            r.close()
    return row


# ---- report ---------------------------------------------------------------------------------------


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load avg " + " ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores{load}"


def _nixl_version() -> str:
    from importlib import metadata

    from transfer.nixl_bridge import load_nixl

    api = load_nixl()
    module = api[0].__module__.split(".")[0] if api else "?"
    for dist in ("nixl", module.replace("_", "-")):
        try:
            return f"{metadata.version(dist)} ({module})"
        except metadata.PackageNotFoundError:
            continue
    return f"unknown ({module})"


def row_status(row: dict) -> tuple[str | None, str]:
    """A result row's ending, shared by both flows' tables: ``(line, "")`` for a ratio that did not run (the line
    to print), else ``(None, verified)`` with ``verified`` "yes" or the problems found."""
    if "unsupported" in row:
        return f"{row['ratio']:>5}  n/a (the model does not shard so): {row['unsupported']}", ""
    if "error" in row:
        return f"{row['ratio']:>5}  FAILED: {row['error']}", ""
    return None, "yes" if row["verified"] else "NO: " + "; ".join(row["problems"])
