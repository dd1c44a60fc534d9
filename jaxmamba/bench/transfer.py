"""``python -m jaxmamba.bench transfer``: P/D state transfer across TP sizes over real NIXL READs.

For every ``P_TP/D_TP`` ratio (``--ratios``) a prefill engine of ``P_TP`` ranks runs in a spawned
process (``transfer.pages.synthetic_prefill_main``: one NIXL agent per P rank, each rank's pages
in vLLM's layout filled with its shard of a seeded random state). This process is the decode
engine: one ``PageImporter`` (NIXL agent, UCX backend) per D rank, destination pages registered
in host memory, agent metadata and page directories received over a multiprocessing Pipe. The
request workload is ``--requests`` prompts of ``--prompt-len`` tokens: per request one Mamba
state slot per Mamba layer (conv + SSM state) and ``ceil(prompt_len / block_size)`` KV blocks per
attention layer. After ``connect`` each D rank READs every request's pages with
``read_request`` (exactly the ``TransferPlan`` byte ranges, completion notification to the P
ranks included), requests one after another and D ranks one after another in this one process.

Reported per ratio: bytes per request summed over the D ranks (Mamba and KV apart; with GQA
replication on D, replicated KV heads are read once per D rank that holds them), READ
descriptors per request, the P ranks each D rank reads from, the wall time of all READs (cold:
the first pass, which also wires up UCX endpoints; warm: the median of the later passes) and the
achieved bandwidth (bytes / warm wall time, GB = 1e9 bytes). Every pass starts from
sentinel-filled destinations; after the last one each D rank's pages are compared byte for byte
with what its own sharding holds (``transfer.pages``, independent of the plan), unread slots
and blocks must still hold the sentinel, the bytes the bridge reports must equal the plan's, and
every P rank must have received each request's notification from every D rank that read from it.

Host memory on both sides (the synthetic prefill engine maps host pages); UCX chooses its
transports between the two processes (``UCX_TLS`` if set). Exit status 1 if any verification
failed; 0 with a message (and no table) if NIXL is not importable.

``--engine``: the engine flow instead (``jaxmamba.engine.disagg``). Per ratio a prefill ``LLM``
(P_TP) and a decode ``LLM`` (D_TP) of the random model run in two spawned processes; P computes
each prompt's first N-1 tokens and stages its pages, D READs them (every D rank, one after another),
installs them and decodes ``--max-tokens`` greedy tokens. Reported: requests imported, bytes READ
per request over all D ranks, descriptors, READ ms per request (the bridge's wall time of every D
rank's READ, summed) and the bandwidth (bytes / READ time), plus the wall time of the prefill and
decode calls. Verified: every request imported, the D engine's tokens equal what the same engine
computes from the prompts alone, no slot, staging page or compilation left over, and P heard every
reader (its staging is empty again).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_RATIOS = "1/2,1/4,2/4,2/1,4/2,4/1,1/1"
SENTINEL = 0xAB
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- workload -----------------------------------------------------------------------------------


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """``"1/2,4/1"`` -> ``[(1, 2), (4, 1)]`` (P_TP/D_TP)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            p, d = (int(v) for v in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"ratio {item!r} is not P_TP/D_TP (e.g. 2/4)") from None
        if p <= 0 or d <= 0:
            raise argparse.ArgumentTypeError(f"ratio {item!r}: TP sizes must be positive")
        out.append((p, d))
    if not out:
        raise argparse.ArgumentTypeError("no ratios given")
    return out


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


HEADER = (f"{'P/D':>5} {'ratio':>5} {'src':>3} {'Mamba B/req':>12} {'KV B/req':>11} {'total B/req':>12} "
          f"{'descs/req':>9} {'cold ms':>8} {'READ ms':>8} {'ms/req':>7} {'GB/s':>6}  verified")


def format_row(row: dict) -> str:
    if "unsupported" in row:
        return f"{row['ratio']:>5}  n/a (the model does not shard so): {row['unsupported']}"
    if "error" in row:
        return f"{row['ratio']:>5}  FAILED: {row['error']}"
    ok = "yes" if row["verified"] else "NO: " + "; ".join(row["problems"])
    return (f"{row['ratio']:>5} {row['tp_ratio']:>+5d} {row['sources_per_d_rank']:>3d} "
            f"{row['mamba_bytes_per_request']:>12,d} {row['kv_bytes_per_request']:>11,d} "
            f"{row['bytes_per_request']:>12,d} {row['descriptors_per_request']:>9,.0f} "
            f"{1e3 * row['cold_wall_s']:>8.2f} {1e3 * row['wall_s']:>8.2f} {row['ms_per_request']:>7.3f} "
            f"{row['gb_per_s']:>6.2f}  {ok}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxmamba.bench transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", type=parse_ratios, default=parse_ratios(DEFAULT_RATIOS),
                   help=f"comma-separated P_TP/D_TP pairs (default {DEFAULT_RATIOS})")
    p.add_argument("--family", default="nemotron_h")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (KV blocks = ceil(len / block))")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="conv and KV cache dtype (default: the model's dtype)")
    p.add_argument("--ssm-dtype", default=None, choices=sorted(_DTYPES), help="SSM state dtype (default: --dtype)")
    p.add_argument("--kv-layout", default="NHD", choices=["NHD", "HND"],
                   help="KV block layout on both engines (NHD: jaxmamba's; HND: vLLM's for heterogeneous TP)")
    p.add_argument("--d-pages", default="jaxmamba", choices=["jaxmamba", "vllm"],
                   help="decode-side Mamba pages: separate conv/SSM arrays (jaxmamba.cache) or vLLM's unified page")
    p.add_argument("--repeats", type=int, default=5, help="passes over all requests; the first is reported as cold")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per READ before it counts as failed")
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for both engines, e.g. 'tcp' for TCP over loopback only (default: the environment's "
                        "UCX_TLS, else UCX picks: shared memory / CMA between processes on one host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows (and the run's metadata) here")
    p.add_argument("--engine", action="store_true",
                   help="the engine flow: prefill and decode LLMs in two processes (jaxmamba.engine.disagg)")
    p.add_argument("--max-tokens", type=int, default=4, help="--engine: greedy tokens decoded per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="--engine: the engines' token budget")
    p.add_argument("--compile-cache", default=None,
                   help="--engine: JAX compile cache both processes share (default: a fresh directory for the run)")
    args = p.parse_args(argv)
    if args.requests <= 0 or args.prompt_len <= 0 or args.block_size <= 0 or args.repeats <= 0:
        p.error("--requests, --prompt-len, --block-size and --repeats must be positive")

    from transfer.nixl_bridge import nixl_available

    if not nixl_available():
        print("SKIPPED: NIXL is not importable (install the 'nixl' extra: pip install -e '.[nixl]'); "
              "the transfer benchmark needs real NIXL agents")
        return 0
    if not os.environ.get("NIXL_LOG_LEVEL"):  # one INFO line per agent would break up the table
        logging.getLogger("nixl").setLevel(logging.WARNING)
    saved_tls = os.environ.get("UCX_TLS")
    if args.ucx_tls:  # read by UCX when each agent's backend is created (here and in the P process)
        os.environ["UCX_TLS"] = args.ucx_tls
    try:
        return (_run_engine if args.engine else _run)(p, args, argv)
    finally:
        if args.ucx_tls:
            if saved_tls is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved_tls


def _run(p: argparse.ArgumentParser, args: argparse.Namespace, argv) -> int:
    from jaxmamba.config import HybridConfig
    from jaxmamba.random_checkpoint import random_config_dict
    from transfer.hetero_tp import TransferShape

    cfg = HybridConfig.from_hf(random_config_dict(args.family, args.size))
    dtype = args.dtype or str(cfg.hf_config.get("dtype") or cfg.hf_config.get("torch_dtype") or "float32")
    ssm_dtype = args.ssm_dtype or dtype
    if dtype not in _DTYPES or ssm_dtype not in _DTYPES:
        p.error(f"unsupported dtype {dtype!r}/{ssm_dtype!r}")
    shape = TransferShape.from_config(cfg, conv_dtype=_DTYPES[dtype], ssm_dtype=_DTYPES[ssm_dtype],
                                      kv_dtype=_DTYPES[dtype], block_size=args.block_size, kv_layout=args.kv_layout)
    work = Workload.build(cfg, args.requests, args.prompt_len, args.block_size, args.seed)

    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m jaxmamba.bench transfer", shlex.join(given)]).rstrip()
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host=_host(), nixl=_nixl_version(),
        ucx_tls=os.environ.get("UCX_TLS", "unset (UCX picks)"), python=platform.python_version(), command=command,
        family=cfg.family, size=args.size, num_layers=cfg.num_hidden_layers,
        mamba_layers=len(work.mamba_layers), attention_layers=len(work.kv_layers), dtype=dtype, ssm_dtype=ssm_dtype,
        kv_layout=args.kv_layout, d_pages=args.d_pages, block_size=args.block_size, requests=args.requests,
        prompt_len=args.prompt_len, blocks_per_request=work.blocks_per_request, repeats=args.repeats,
        transfer_shape=dataclasses.asdict(shape),
    )
    _print_setup(meta, cfg, args, shape, work)
    out_rows = _run_ratios(args, shape, work)
    idle = [(r["ratio"], r["p_idle_cpu_cores"], r["d_idle_cpu_cores"]) for r in out_rows
            if r.get("p_idle_cpu_cores") is not None and r.get("d_idle_cpu_cores") is not None]
    if idle:
        print("CPU used while idle (after connect, before the READs; NIXL progress threads): "
              + ", ".join(f"{ratio} P {p:.2f} / D {d:.2f} cores" for ratio, p, d in idle)
              + f" -- on {os.cpu_count()} cores shared by both processes")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": out_rows}, indent=2, default=str))
    failed = [r["ratio"] for r in out_rows if "unsupported" not in r and not r.get("verified")]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the rows above)")
        return 1
    ran = [r for r in out_rows if "unsupported" not in r]
    print(f"{len(ran)} ratio(s) verified: every D rank's pages equal its own sharding of the P state, "
          "unread pages untouched, every notification delivered")
    return 0


def _print_setup(meta: dict, cfg, args: argparse.Namespace, shape, work: Workload) -> None:
    """The run's header: where and what it measures, then the table's columns."""
    command, dtype, ssm_dtype = meta["command"], meta["dtype"], meta["ssm_dtype"]
    print("transfer benchmark: real NIXL READs (UCX backend) from a spawned prefill process into this "
          "decode process, host memory on both sides")
    print(f"date: {meta['date']}   host: {meta['host']}")
    print(f"nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}, python {meta['python']}")
    print(f"command: {command}")
    print(f"model: {cfg.family} {args.size} (random), {cfg.num_hidden_layers} layers: {len(work.mamba_layers)} Mamba2 "
          f"(heads {shape.num_heads}x{shape.head_dim}, n_groups {shape.n_groups}, d_state {shape.d_state}, "
          f"conv {shape.conv_kernel}), {len(work.kv_layers)} attention (kv heads {shape.num_kv_heads}x"
          f"{shape.attn_head_dim}); conv/KV {dtype}, SSM {ssm_dtype}")
    print(f"workload: {args.requests} requests x {args.prompt_len} tokens: per request 1 Mamba slot per Mamba layer "
          f"+ {work.blocks_per_request} KV blocks of {args.block_size} per attention layer ({args.kv_layout}); "
          f"D Mamba pages: {args.d_pages}; {args.repeats} passes (cold = first, READ ms = median of the rest)")
    print("columns: ratio = signed D_TP/P_TP (vLLM); src = P ranks one D rank reads from; B/req = bytes per request "
          "over all D ranks; READ ms = all requests x all D ranks, one after another")
    print(HEADER)


def _run_ratios(args: argparse.Namespace, shape, work: Workload) -> list[dict]:
    """One row per ``--ratios`` entry, in that order, printed as it completes: one prefill process per P_TP
    serves every ratio with that P_TP."""
    from jaxmamba.errors import ConfigError, TransferError
    from transfer.hetero_tp import TransferPlan

    rows: dict[tuple[int, int], dict] = {}
    by_p: dict[int, list[int]] = {}
    for p_tp, d_tp in args.ratios:
        try:
            TransferPlan(shape, p_tp, d_tp, 0)  # refuses a TP size the model cannot be sharded over
        except (ConfigError, TransferError) as err:
            rows[(p_tp, d_tp)] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, unsupported=str(err))
            continue
        if d_tp not in by_p.setdefault(p_tp, []):
            by_p[p_tp].append(d_tp)
    printed = 0
    order = list(dict.fromkeys(args.ratios))

    def flush() -> None:
        nonlocal printed
        while printed < len(order) and order[printed] in rows:
            print(format_row(rows[order[printed]]), flush=True)
            printed += 1

    for p_tp, d_tps in by_p.items():
        spec = dict(shape=dataclasses.asdict(shape), p_tp=p_tp, num_slots=work.num_slots, num_blocks=work.num_blocks,
                    seed=args.seed, mamba_layers=list(work.mamba_layers), kv_layers=list(work.kv_layers), p_pad=0,
                    engine_id=f"prefill-p{p_tp}-{os.getpid()}",
                    env={"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
                         **({"UCX_TLS": os.environ["UCX_TLS"]} if "UCX_TLS" in os.environ else {})})
        prefill = PrefillProcess(spec, timeout_s=max(120.0, args.timeout))
        try:
            for d_tp in d_tps:
                try:
                    rows[(p_tp, d_tp)] = run_ratio(prefill, spec, shape, work, p_tp, d_tp, args)
                except (ConfigError, TransferError) as err:
                    rows[(p_tp, d_tp)] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, verified=False,
                                              error=f"{type(err).__name__}: {err}")
                flush()
        finally:
            prefill.shutdown()
    flush()
    return [rows[k] for k in order]


# ---- the engine flow (--engine) -------------------------------------------------------------------

ENGINE_HEADER = (f"{'P/D':>5} {'ratio':>5} {'imported':>8} {'B/req':>12} {'descs/req':>9} {'READ ms/req':>11} "
                 f"{'GB/s':>6} {'prefill s':>9} {'decode s':>8}  verified")


def format_engine_row(row: dict) -> str:
    if "unsupported" in row:
        return f"{row['ratio']:>5}  n/a (the model does not shard so): {row['unsupported']}"
    if "error" in row:
        return f"{row['ratio']:>5}  FAILED: {row['error']}"
    ok = "yes" if row["verified"] else "NO: " + "; ".join(row["problems"])
    return (f"{row['ratio']:>5} {row['tp_ratio']:>+5d} {row['imported']:>4d}/{row['requests']:<3d} "
            f"{row['bytes_per_request']:>12,.0f} {row['descriptors_per_request']:>9,.0f} "
            f"{row['read_ms_per_request']:>11.3f} {row['gb_per_s']:>6.2f} {row['prefill_s']:>9.2f} "
            f"{row['decode_s']:>8.2f}  {ok}")


def run_engine_ratio(model: str, prompts: list[list[int]], p_tp: int, d_tp: int, engine_args: dict,
                     args: argparse.Namespace, compile_cache: str) -> dict:
    """One P_TP/D_TP pair through ``jaxmamba.engine.disagg``'s processes; a row of ``--engine``'s table."""
    from jaxmamba.engine.disagg import EngineProcess, Handoff, decode_process_main, prefill_process_main
    from transfer.hetero_tp import signed_tp_ratio

    env = {"JAX_PLATFORMS": "cpu", "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
           **({"UCX_TLS": os.environ["UCX_TLS"]} if "UCX_TLS" in os.environ else {})}

    def spec(tp: int, engine: dict, **extra) -> dict:
        return {"env": {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}"},
                "compile_cache": compile_cache, "engines": {"m": engine}, **extra}

    tag = f"bench{os.getpid()}"
    row: dict[str, Any] = dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, tp_ratio=signed_tp_ratio(p_tp, d_tp),
                               requests=len(prompts))
    procs = []
    try:
        # P keeps NIXL's progress thread here (as a deployment would), so READs do not wait for its loop.
        prefill = EngineProcess(prefill_process_main, spec(p_tp, {
            "model": model, "engine_id": f"{tag}-P{p_tp}", "staging_requests": len(prompts),
            "engine_args": dict(engine_args, tensor_parallel_size=p_tp)}, progress_thread=True))
        procs.append(prefill)
        decode = EngineProcess(decode_process_main, spec(d_tp, {
            "model": model, "name": f"{tag}-D{d_tp}", "staging_requests": len(prompts), "timeout_s": args.timeout,
            "engine_args": dict(engine_args, tensor_parallel_size=d_tp)}))
        procs.append(decode)
        problem = decode.call("connect", "m", prefill.ready["m"])
        if problem:
            return dict(row, verified=False, error=problem)
        params = dict(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        handoffs = prefill.call("prefill", "m", prompts)
        t1 = time.perf_counter()
        result = decode.call("generate", "m", handoffs, params)
        t2 = time.perf_counter()
        local = decode.call("generate", "m", [Handoff("none", tuple(p)).to_bytes() for p in prompts], params)
        records = [r for r in result["transfers"] if r is not None]
        imported = [r for r in records if r["status"] == "imported"]
        total_bytes = sum(r["bytes_read"] for r in imported)
        read_s = sum(r["read_seconds"] for r in imported)
        n = max(len(imported), 1)
        problems = []
        if len(imported) != len(prompts):
            problems.append(f"{len(prompts) - len(imported)} request(s) not imported: "
                            + "; ".join(sorted({str(r['error']) for r in records if r["status"] != "imported"})))
        if result["outputs"] != local["outputs"]:
            bad = sum(a != b for a, b in zip(result["outputs"], local["outputs"], strict=True))
            problems.append(f"{bad} request(s) decode other tokens than the D engine computes from the prompt")
        for key in ("slots_in_use", "blocks_in_use", "staging_in_use", "compiles_while_serving"):
            if result[key]:
                problems.append(f"{key}={result[key]}")
        if result["invariants"]:
            problems.append(result["invariants"])
        deadline = time.monotonic() + 10
        while (staged := prefill.call("poll")) != {"m": 0} and time.monotonic() < deadline:
            time.sleep(0.01)
        if staged != {"m": 0}:
            problems.append(f"P still stages {staged['m']} handoff(s): not every reader notified it")
        row.update(imported=len(imported), bytes_per_request=total_bytes / n,
                   descriptors_per_request=sum(r["num_descriptors"] for r in imported) / n,
                   read_ms_per_request=1e3 * read_s / n, gb_per_s=total_bytes / max(read_s, 1e-9) / 1e9,
                   prefill_s=t1 - t0, decode_s=t2 - t1, verified=not problems, problems=problems)
        return row
    finally:
        for proc in procs:
            proc.close()


def _run_engine(p: argparse.ArgumentParser, args: argparse.Namespace, argv) -> int:
    import tempfile

    from jaxmamba.config import HybridConfig
    from jaxmamba.errors import ConfigError, TransferError
    from jaxmamba.random_checkpoint import random_model
    from transfer.hetero_tp import TransferPlan, TransferShape

    if args.dtype or args.ssm_dtype or args.kv_layout != "NHD" or args.d_pages != "jaxmamba":
        p.error("--engine runs the engines' own caches: float32, NHD KV, jaxmamba pages (drop --dtype/--ssm-dtype/"
                "--kv-layout/--d-pages)")
    if args.max_tokens <= 0 or args.max_num_batched_tokens <= 0:
        p.error("--max-tokens and --max-num-batched-tokens must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="jaxmamba-bench-transfer-"))
    model = str(random_model(args.family, args.size, seed=args.seed, path=workdir / "model"))
    compile_cache = args.compile_cache or str(workdir / "jax_cache")
    cfg = HybridConfig.from_hf(json.loads((Path(model) / "config.json").read_text()))
    shape = TransferShape.from_config(cfg, conv_dtype=4, ssm_dtype=4, kv_dtype=4, block_size=args.block_size)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(args.requests)]
    max_num_seqs = min(args.requests, 8)
    batched = max(args.max_num_batched_tokens, max_num_seqs)
    engine_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, block_size=args.block_size,
                       max_model_len=args.prompt_len + args.max_tokens, buckets=[(max_num_seqs, batched)])

    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m jaxmamba.bench transfer", shlex.join(given)]).rstrip()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), host=_host(), nixl=_nixl_version(),
                ucx_tls=os.environ.get("UCX_TLS", "unset (UCX picks)"), python=platform.python_version(),
                command=command, mode="engine", family=cfg.family, size=args.size, requests=args.requests,
                prompt_len=args.prompt_len, max_tokens=args.max_tokens, engine_args=engine_args)
    print("transfer benchmark, engine flow: a prefill LLM and a decode LLM in two spawned processes, real NIXL "
          "READs of each request's staged pages (jaxmamba.engine.disagg)")
    print(f"date: {meta['date']}   host: {meta['host']}")
    print(f"nixl {meta['nixl']}, UCX_TLS={meta['ucx_tls']}, python {meta['python']}")
    print(f"command: {command}")
    print(f"model: {cfg.family} {args.size} (random), {len(cfg.mamba_layer_ids)} Mamba2 + "
          f"{len(cfg.attention_layer_ids)} attention layers, float32 caches; {args.requests} prompts x "
          f"{args.prompt_len} tokens (P computes {args.prompt_len - 1}), {args.max_tokens} greedy tokens on D; "
          f"engines: {engine_args}")
    print("columns: B/req = bytes READ per request over all D ranks; READ ms/req = every D rank's READ, one after "
          "another; prefill s / decode s = wall time of the whole prefill / decode call")
    print(ENGINE_HEADER)
    rows = []
    for p_tp, d_tp in dict.fromkeys(args.ratios):
        try:
            TransferPlan(shape, p_tp, d_tp, 0)
        except (ConfigError, TransferError) as err:
            rows.append(dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, unsupported=str(err)))
        else:
            try:
                rows.append(run_engine_ratio(model, prompts, p_tp, d_tp, engine_args, args, compile_cache))
            except (ConfigError, TransferError) as err:
                rows.append(dict(ratio=f"{p_tp}/{d_tp}", p_tp=p_tp, d_tp=d_tp, verified=False,
                                 error=f"{type(err).__name__}: {err}"))
        print(format_engine_row(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    failed = [r["ratio"] for r in rows if "unsupported" not in r and not r.get("verified")]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the rows above)")
        return 1
    print(f"{sum('unsupported' not in r for r in rows)} ratio(s) verified: every request imported, the same tokens "
          "as the decode engine alone, nothing left over on either engine")
    return 0
