"""``python -m jaxmamba.bench host-inputs``: time ``ModelRunner._inputs`` (a step's host inputs) per call.

A development A/B tool for the host path, without cProfile. The engine runs the tiny default checkpoint with the compiled steps replaced by a stand-in that
samples deterministic pseudo-random tokens (no compile, no device: only the host path is measured). Every
step's ``_inputs`` is re-run ``--repeats`` times on the same scheduler output (it only reads engine state)
and timed with ``time.perf_counter``; calls are grouped by scenario and step kind (decode-only bucket or
mixed). ``--dump FILE`` pickles every step's outputs (bucket, order, int/float buffers, the entries
the step wrote in the device block table and state table, num_decodes): two trees' dumps must be equal (``--compare A B``),
which checks that a host-path change leaves every value of every step as it was.

    PYTHONPATH=<tree> python -m jaxmamba.bench host-inputs [--scenarios b8,b256] [--dump out.pkl]
    python -m jaxmamba.bench host-inputs --compare before.pkl after.pkl
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from collections import defaultdict

import numpy as np


def _fake_steps_class():
    """A ``CompiledSteps`` stand-in: the same attributes, ``run`` samples tokens from a seeded generator
    (accepting a pseudo-random number of each row's drafts), caches untouched; ``dispatch``/``read`` do the
    same for async scheduling (``bench host-path``). Its sampling is timed as the ``wait`` phase: it stands
    for the device's work, not the host's. ``dispatch`` hands out device arrays made when the stand-in is
    built (a pool of pseudo-random token arrays per bucket, cycled): making them per call costs the host
    ~0.3 ms a step on the CPU client (three array creations), more than a real step's enqueue, which
    ``bench host-path`` would count as the engine's dispatch."""
    import jax

    from jaxmamba.aot import MemoryStats
    from jaxmamba.host_profile import maybe_phase
    from jaxmamba.program_builder import BuildStats
    from jaxmamba.sampling import FULL
    from jaxmamba.steps import CompiledSteps, int_input_sizes

    class FakeSteps:
        def __init__(self, model, caches, buckets, layouts, *, num_spec=0, **_):
            self.buckets = tuple(sorted(buckets))
            self.layouts = layouts
            self.num_spec = num_spec
            self.sampling_variants = {b: (FULL,) for b in self.buckets}
            self.num_compilations = 0
            self.build_stats = BuildStats()  # what LLM reads of a build: nothing was built
            self.startup_backend_compiles = self.startup_lowerings = 0
            self.num_programs_planned = self.programs_ready = len(self.buckets)
            self.num_deferred_restores = self.programs_restored = 0
            # What a GPU's pool sizing reads of the largest bucket (sizing.gpu_cache_budget): no temporaries.
            self.memory = {b: MemoryStats(0, 0, 0, 0) for b in self.buckets}
            self.build_workers = 0  # the engine records its build threads (StartupTimes.build_threads): none
            self.vocab = model.cfg.vocab_size
            self.rng = np.random.default_rng(1234)
            # dispatch's outputs per bucket: [token arrays it cycles through, the next one's index], and the
            # accepted counts (async scheduling has no drafts: zeros). Their own generator: run's tokens (and
            # so host-inputs dumps) stay those of earlier trees.
            self._pool_rng = np.random.default_rng(4321)
            self._outputs = {b: [[self._device_tokens(b) for _ in range(_DISPATCH_POOL)], 0] for b in self.buckets}
            self._zero_accepted = {b: jax.device_put(np.zeros(b.num_reqs, np.int32)) for b in self.buckets}
            self._last_tokens = jax.device_put(np.zeros(max(b.num_reqs for b in self.buckets), np.int32))

        def _device_tokens(self, bucket):
            return jax.device_put(self._pool_rng.integers(3, self.vocab, (bucket.num_reqs, 1 + self.num_spec)
                                                          ).astype(np.int32))

        def has_window(self, bucket):
            return False  # one step a call: this bench times the host inputs of single steps

        def run(self, bucket, caches, int_buf, float_buf, block_table, state_table, profile=None, variant=FULL,
                multi_step=False, read_logprobs=True):
            with maybe_phase(profile, "wait"):
                return self._sample(bucket, int_buf), caches

        def _sample(self, bucket, int_buf):
            r, s = bucket.num_reqs, 1 + self.num_spec
            offset = self.layouts[bucket].size
            for name, size in int_input_sizes(bucket, self.num_spec).items():
                if name == "num_drafts":
                    num_drafts = np.asarray(int_buf[offset : offset + size])
                offset += size
            tokens = self.rng.integers(3, self.vocab, (r, s)).astype(np.int32)
            accepted = np.minimum(num_drafts, self.rng.integers(0, s, r)).astype(np.int32)
            return tokens, accepted, None, None, None, None

        def dispatch(self, bucket, caches, int_buf, float_buf, block_table, state_table, prev_last_tokens=None,
                     profile=None, variant=FULL, multi_step=False):
            # Device arrays, as a step's outputs (the dispatch thread starts their copies); last_tokens: zeros.
            entry = self._outputs[bucket]
            pool, i = entry
            entry[1] = (i + 1) % len(pool)
            return (pool[i], self._zero_accepted[bucket], None, None, None, None, self._last_tokens), caches

        read = staticmethod(CompiledSteps.read)

    return FakeSteps


def copy_through_caches(source: np.ndarray, destination: np.ndarray) -> None:
    """The stand-in device's memory traffic: ``source`` copied into ``destination`` (same shape)."""
    np.copyto(destination, source)


def _with_device_traffic(steps_class, mib: int):
    """``steps_class`` (``_fake_steps_class()``) whose every step also copies a buffer of ``mib`` MiB on the engine
    thread, inside the ``wait`` phase (``run``, or ``read`` under async scheduling): the memory a CPU device's step
    streams through the host's caches between the host's phases, which then run with those caches cold (the tiny
    default's steps move 8 MiB of caches and 2-30 MiB of temporaries; BENCHMARKS.md, "Session 29")."""
    from jaxmamba.host_profile import maybe_phase

    # float64[mib << 17]: mib MiB each; ones, so that every page is touched (no zero-page sharing).
    traffic = (np.ones(mib << 17), np.ones(mib << 17))

    class WithDeviceTraffic(steps_class):
        def run(self, bucket, caches, int_buf, float_buf, block_table, state_table, profile=None, *args, **kwargs):
            with maybe_phase(profile, "wait"):
                copy_through_caches(*traffic)
            return super().run(bucket, caches, int_buf, float_buf, block_table, state_table, profile, *args,
                               **kwargs)

        @staticmethod
        def read(outputs, profile=None, logprobs=True):
            with maybe_phase(profile, "wait"):
                copy_through_caches(*traffic)
            return steps_class.read(outputs, profile, logprobs)

    return WithDeviceTraffic


SCENARIOS = {
    # name: (engine kwargs, number of requests, prompt lengths, max_tokens range)
    "b8": (dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=97), 8, (32, 32), (64, 64)),
    "b8mix": (dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=97), 32, (8, 40), (4, 48)),
    "b256": (dict(max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=97), 256, (32, 32), (64, 64)),
    "b256mix": (dict(max_num_seqs=256, max_num_batched_tokens=512, max_model_len=97), 768, (8, 40), (4, 48)),
    # Coverage for --compare (prefix caching, spec decode): not part of the timing table.
    "align": (dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=97, enable_prefix_caching=True,
                   block_size=16), 48, (8, 60), (4, 30)),
    "all": (dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=97, enable_prefix_caching=True,
                 mamba_cache_mode="all", block_size=16,
                 speculative_config=dict(method="ngram", num_speculative_tokens=2)), 48, (8, 60), (4, 30)),
    "spec": (dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=97,
                  speculative_config=dict(method="ngram", num_speculative_tokens=3)), 48, (8, 40), (4, 40)),
}


def stubbed_llm(path: str | None = None, device_traffic_mib: int = 0, **engine_args):
    """An ``LLM`` on ``path`` (default: the tiny default checkpoint) whose compiled steps are
    ``_fake_steps_class``'s stand-in (nothing compiled; steps sample on the host), each step streaming
    ``device_traffic_mib`` MiB through the host's caches where > 0 (``_with_device_traffic``)."""
    from jaxmamba.bench.decode import checkpoint_for
    from jaxmamba.engine import runner as runner_mod
    from jaxmamba.engine.llm import LLM

    stand_in = _fake_steps_class()
    if device_traffic_mib:
        stand_in = _with_device_traffic(stand_in, device_traffic_mib)
    real_steps, runner_mod.CompiledSteps = runner_mod.CompiledSteps, stand_in
    try:
        return LLM(str(path or checkpoint_for("tiny")), **engine_args)
    finally:
        runner_mod.CompiledSteps = real_steps


def stubbed_host_profiles(llm, prompts, max_tokens, passes: int) -> list[dict]:
    """Each of ``passes`` passes' ``HostProfile.summary()``: ``prompts`` (greedy, ``max_tokens[i]`` tokens each)
    through ``llm``, a ``stubbed_llm``: the engine's host path alone, with no device beside it to share the
    host's cores and caches, and none watched (``HostProfile(device_time=False)``)."""
    from jaxmamba.engine.request import SamplingParams
    from jaxmamba.host_profile import HostProfile

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    summaries = []
    for _ in range(passes):
        llm.host_profile = HostProfile(device_time=False)
        try:
            llm.generate(prompts, params, use_tqdm=False)
            summaries.append(llm.host_profile.summary())
        finally:
            llm.host_profile = None
    return summaries


_NO_UPDATES = np.zeros((0, 3), np.int32)
_DISPATCH_POOL = 16  # token arrays per bucket that the stand-in's dispatch cycles through


def run_scenario(name: str, repeats: int, timings: dict, dumps: list) -> None:
    from jaxmamba.engine import runner as runner_mod
    from jaxmamba.engine.request import SamplingParams

    kwargs, num_requests, prompt_range, max_tokens_range = SCENARIOS[name]
    # Synchronous steps: every step's inputs are built from host-known tokens (none read on the device).
    llm = stubbed_llm(async_scheduling=False, **kwargs)
    rng = np.random.default_rng(7)
    # A few shared prefixes, so the prefix-caching scenarios hit.
    prefixes = [rng.integers(3, 500, 48).tolist() for _ in range(4)]
    prompts, params = [], []
    for i in range(num_requests):
        length = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        head = prefixes[i % 4][: length // 2] if kwargs.get("enable_prefix_caching") else []
        prompts.append(head + rng.integers(3, 500, length - len(head)).tolist())
        max_tokens = int(rng.integers(max_tokens_range[0], max_tokens_range[1] + 1))
        if name.startswith("b8") or name.startswith("b256"):
            params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens))
        else:  # varied sampling fields, for --compare (the stand-in steps ignore them)
            params.append(SamplingParams(
                temperature=float(rng.choice([0.0, 0.7, 1.3])), top_p=float(rng.choice([1.0, 0.9])),
                top_k=int(rng.choice([0, -1, 5])), min_p=float(rng.choice([0.0, 0.05])),
                min_tokens=int(rng.choice([0, 3])), seed=[None, 123][i % 2], ignore_eos=bool(i % 3),
                max_tokens=max_tokens))
    original = runner_mod.ModelRunner._inputs

    def timed(self, sched):
        tables = (self.block_table, self.state_table)
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(repeats):
            tickets = [t.ticket for t in tables]
            out = original(self, sched)
            if i == 0:  # the entries the step writes in the device tables (a repeat finds them written: none)
                # A table the step did not write (its write number did not move) holds an earlier step's updates.
                written, state_written = (np.array(t.last_updates if t.ticket != k else _NO_UPDATES, copy=True)
                                          for t, k in zip(tables, tickets, strict=True))
        per_call = (time.perf_counter() - start) / repeats
        cpu_per_call = (time.process_time() - cpu_start) / repeats
        bucket = out.bucket  # out: engine.input_batch.StepInputs
        timings[name, "decode" if bucket.decode_only else "mixed"].append((per_call, len(sched), cpu_per_call))
        dumps.append((name, (bucket.num_tokens, bucket.num_reqs, bucket.decode_only, bucket.num_prefills),
                      *(np.array(a, copy=True) for a in (out.order, out.int_buf, out.float_buf)), written,
                      state_written, int(out.num_decodes)))
        return out

    runner_mod.ModelRunner._inputs = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner_mod.ModelRunner._inputs = original


def compare(a_path: str, b_path: str) -> int:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    if len(a) != len(b):
        print(f"different step counts: {len(a)} vs {len(b)}")
        return 1
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for j, (u, v) in enumerate(zip(x, y, strict=True)):
            same = (u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)) if isinstance(
                u, np.ndarray) else u == v
            if not same:
                print(f"step {i} ({x[0]}) differs in output field {j}: {u!r} vs {v!r}")
                return 1
    print(f"{len(a)} steps identical")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxmamba.bench host-inputs",
                                 description="Time ModelRunner._inputs (a step's host inputs) per call; --dump, --compare.")
    ap.add_argument("--scenarios", default="b8,b8mix,b256,b256mix",
                    help=f"comma-separated, of {','.join(SCENARIOS)}")
    ap.add_argument("--repeats", type=int, default=20, help="calls of _inputs timed per step")
    ap.add_argument("--dump", help="pickle every step's outputs here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --dump files and exit")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    if args.compare:
        return compare(*args.compare)
    import jaxmamba

    print(f"jaxmamba from {os.path.dirname(jaxmamba.__file__)}; load average before "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    timings: dict = defaultdict(list)
    dumps: list = []
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}: choose from {','.join(SCENARIOS)}")
    for name in names:
        run_scenario(name, args.repeats, timings, dumps)
    # Wall (perf_counter) per call, and CPU (process_time) per call: on a loaded machine the CPU time is
    # the steadier of the two (time spent waiting for a core is not counted).
    print(f"{'scenario':10} {'kind':7} {'steps':>5} {'rows(mean)':>10} {'median us':>10} {'mean us':>9} "
          f"{'cpu med us':>10}")
    for (name, kind), rows in timings.items():
        per_call = [t for t, _, _ in rows]
        print(f"{name:10} {kind:7} {len(rows):5d} {statistics.mean(n for _, n, _ in rows):10.1f} "
              f"{1e6 * statistics.median(per_call):10.1f} {1e6 * statistics.mean(per_call):9.1f} "
              f"{1e6 * statistics.median(c for _, _, c in rows):10.1f}")
    print(f"load average after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.dump:
        with open(args.dump, "wb") as f:
            pickle.dump(dumps, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
