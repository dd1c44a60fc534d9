"""Jit-compiled steps over static buckets: our analogue of vLLM's full CUDA graphs.

``CompiledSteps`` builds one executable per bucket (``jaxmamba.buckets``) and sampling variant
(``bucket_sampling_variants``) ahead of time, caches donated; ``run``/``dispatch`` only call them, and
they refuse any other shape, so serving never compiles (``num_compilations`` and a ``jax.monitoring``
listener let tests prove it). Per step the host sends ``int_buf`` (int32: the packed metadata, then
``int_input_sizes``' fields) and ``float_buf`` (temperature, top-p, min-p); the attention block table
(``int32[block_table_rows, cdiv(max_model_len, block_size)]``) and the Mamba state-index table
(``int32[block_table_rows, mamba_block_table_columns]``) stay on the device between steps, read at
``int_buf``'s ``row_map``; ``prev_last_tokens`` (``int32[max_rows]``) is the previous step's
``last_tokens`` output, read under async scheduling. With ``num_scheduler_steps`` K > 1 each pure-decode
bucket also has a window program of up to K decode steps. The parameters are flattened once, at
construction. Details: docs/architecture.md, "Compiled steps".
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba import aot
from jaxmamba.aot import KernelStats, MemoryStats
from jaxmamba.cache import StateCaches
from jaxmamba.host_profile import HostProfile, maybe_phase
from jaxmamba.buckets import (  # noqa: F401 - the bucket names' old home
    GREEDY_TAIL_MIN_ROWS,
    SAMPLING_VARIANT_POLICIES,
    Bucket,
    bucket_sampling_variants,
    check_sampling_variants,
    default_buckets,
    engine_buckets,
    ladder,
    prefill_rows_ladder,
    select_bucket,
)
from jaxmamba.errors import ConfigError
from jaxmamba.metadata import PackLayout
from jaxmamba.model.serving import StepOptions, cpu_weight_layout, to_weight_layout
from jaxmamba.parallel.distributed import call_arguments, device_put_global
from jaxmamba.program_builder import CompileCounter as _CompileCounter
from jaxmamba.program_builder import (BackgroundRestore, OwnerGone, Program, ProgramBuilder, WeakCallback,
                                      default_workers, stop_at_exit)
from jaxmamba.sampling import FULL, GREEDY, SamplingVariant
from jaxmamba.step_program import (  # noqa: F401 - int_input_sizes' and FLOAT_INPUTS' old home
    FLOAT_INPUTS,
    _multi_step,
    _step,
    int_buffer_size,
    int_input_sizes,
)


#: ``CompiledSteps(compile=...)``: "eager" builds every program before serving; "lazy" the pure-decode
#: buckets and the largest mixed one, then the rest in the background.
COMPILE_MODES = ("eager", "lazy")
#: When an eager engine deserialises the programs its executable cache holds: on a background thread while it
#: serves (a step waits for its own program, restored first), or before the constructor returns.
RESTORE_MODES = ("background", "eager")

#: ``matmul_precision``: how the step's XLA matmuls multiply float32 operands. "auto": a float32 model at full
#: float32 (as torch does), other models at jax's default; "float32": full float32 whatever the model;
#: "tf32": jax's default, which is TF32 on a GPU with tensor cores (faster, ~1e-3 relative).
MATMUL_PRECISIONS = ("auto", "float32", "tf32")


def step_matmul_precision(option: str, dtype) -> str | None:
    """The ``jax.default_matmul_precision`` the step programs are traced under (None: jax's default).

    On a GPU jax's default lets XLA multiply float32 operands in TF32 (10-bit mantissas): a float32 model's
    logits then miss float32 references by ~1e-3, while torch's float32 matmuls do not
    (docs/architecture.md, "Float32 on a GPU"). bfloat16 operands are exact either way."""
    if option not in MATMUL_PRECISIONS:
        raise ConfigError(f"matmul_precision={option!r} must be one of {MATMUL_PRECISIONS}")
    if option == "float32" or (option == "auto" and dtype is not None and jnp.dtype(dtype) == jnp.float32):
        return "float32"
    return None


def _under_precision(lower, precision: str | None):
    """``lower`` traced under ``jax.default_matmul_precision(precision)`` (a thread-local setting: the scope
    goes with the call, whichever thread lowers)."""
    if precision is None:
        return lower

    def lower_at_precision():
        with jax.default_matmul_precision(precision):
            return lower()
    return lower_at_precision


#: Where async scheduling enqueues a step (``EngineConfig.async_dispatch``; docs/architecture.md, "Host path").
ASYNC_DISPATCH_MODES = ("auto", "thread", "inline")


def resolve_async_dispatch(mode: str) -> str:
    """``"thread"`` or ``"inline"`` for ``mode``: ``"auto"`` is a dispatch thread where the steps run on the CPU
    (XLA's CPU client executes a step on the calling thread: inline, the host would wait for each step) and
    inline on an accelerator (which enqueues a step and returns)."""
    if mode not in ASYNC_DISPATCH_MODES:
        raise ConfigError(f"async_dispatch={mode!r} must be one of {ASYNC_DISPATCH_MODES}")
    if mode != "auto":
        return mode
    return "thread" if jax.default_backend() == "cpu" else "inline"


class CompiledSteps:
    """One AOT-compiled executable per bucket and sampling variant; ``run`` never compiles."""

    def __init__(self, model, caches: StateCaches, buckets: tuple[Bucket, ...], layouts: dict[Bucket, PackLayout],
                 *, backend: str = "reference", num_spec: int = 0, mesh=None, target: str | None = None,
                 on_compiled=None, sampling_variants: str = "auto", block_table_rows: int | None = None,
                 state_table_columns: int = 1, num_scheduler_steps: int = 1, compile: str = "eager",
                 executable_cache=None, progress=None, max_workers: int | None = None,
                 matmul_precision: str = "auto", restore: str = "background"):
        """Build (or restore) every bucket's programs; ``compile="lazy"`` returns after the pure-decode
        buckets and the largest mixed bucket, building the rest on a background thread.

        ``block_table_rows``/``state_table_columns``: the persistent block and state-index tables' shapes.
        ``mesh``: a ``jaxmamba.parallel`` mesh (one ``shard_map`` over vLLM's rank shards). ``target``: a GPU
        target of ``jaxmamba.aot`` (``"h100"``) to compile for without the device (executables cannot run;
        ``memory`` and ``kernels`` report). ``on_compiled(bucket)``: called once a bucket is ready.
        ``sampling_variants``: a ``bucket_sampling_variants`` policy. ``num_scheduler_steps`` K > 1: a
        multi-step program per pure-decode bucket. ``executable_cache``: a ``compile_cache.ExecutableCache``;
        ``max_workers``: compile threads; ``progress``: ``begin(total, cached)``/``update()``/``close()``.
        ``matmul_precision``: one of ``MATMUL_PRECISIONS`` (``step_matmul_precision``). ``restore``: one of
        ``RESTORE_MODES`` (an eager build's cached programs restored in the background, or before returning).
        Each argument in full: docs/architecture.md, "Compiled steps" (constructor arguments).
        """
        _CompileCounter.install()
        if compile not in COMPILE_MODES:
            raise ConfigError(f"compile={compile!r} must be one of {COMPILE_MODES}")
        if restore not in RESTORE_MODES:
            raise ConfigError(f"restore={restore!r} must be one of {RESTORE_MODES}")
        if num_scheduler_steps > 1 and num_spec:
            raise ConfigError("num_scheduler_steps > 1 needs no speculative decoding")
        if target is not None and mesh is not None:
            raise ConfigError("compiling for a GPU target is single-device: tensor_parallel_size must be 1")
        self.mesh = mesh
        self.target = target
        self.matmul_precision = step_matmul_precision(matmul_precision, getattr(model, "dtype", None))
        wrap = self._flatten_params(model)
        self.all_buckets = tuple(sorted(buckets))
        self.layouts = layouts
        self.max_rows = max(b.num_reqs for b in self.all_buckets)
        self._zeros_prev = None  # prev_last_tokens of a step whose rows know all their tokens
        self.block_table_rows = self.max_rows + 1 if block_table_rows is None else block_table_rows
        self.state_table_columns = state_table_columns
        self.num_spec = num_spec
        self.num_scheduler_steps = num_scheduler_steps
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.sampling_variants: dict[Bucket, tuple[SamplingVariant, ...]] = {
            b: ((GREEDY, FULL) if sampling_variants == "all" else (FULL,)) if target is not None
            else bucket_sampling_variants(b, sampling_variants, platform)
            for b in self.all_buckets}
        self._executables: dict[tuple[Bucket, SamplingVariant, bool], object] = {}  # (bucket, variant, multi_step)
        self.memory: dict[Bucket, MemoryStats] = {}  # XLA's buffer assignment of each bucket's executable
        self.kernels: dict[Bucket, tuple[KernelStats, ...]] = {}  # per bucket, target compiles only
        self._ready: tuple[Bucket, ...] = ()  # buckets whose programs are all built (published whole)
        self._on_compiled = on_compiled
        self._progress = progress
        self._lock = threading.Lock()
        programs, cache = self._plan_programs(model, caches, wrap, backend, executable_cache)
        self.num_programs_planned = sum(len(p) for p in programs.values())
        #: Each program's key in the executable cache ((bucket, variant, multi_step) -> key; None: not cached).
        self.cache_keys = {p.key: p.cache_key for ps in programs.values() for p in ps}
        self._restore: BackgroundRestore | None = None  # an eager build's cached programs, while they restore
        self._build(programs, self.all_buckets if compile == "eager" else self._first_buckets(), cache,
                    # A GPU target's programs are compiled for that GPU (ptxas runs beside XLA), whatever this host is.
                    max_workers or default_workers(compiles_for_cpu=target is None and platform == "cpu"),
                    defer_restores=compile == "eager" and restore == "background")
        self._weights()

    def _plan_programs(self, model, caches: StateCaches, wrap, backend: str, executable_cache):
        """Every bucket's programs (not yet lowered), and the executable cache they may come from (None: none)."""
        mesh, target = self.mesh, self.target
        # The per-row SSM working set of a window (reference backend) is a CPU speed-up; on a GPU it would be
        # a temporary of R x (every Mamba layer's state) that the planner does not budget.
        ssm_working_set = backend == "reference" and target is None and jax.default_backend() == "cpu"
        # Caches keep their shardings: otherwise a TP step would expect them replicated.
        abstract_caches = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if mesh is not None else None), caches)
        # Restoring is for local single-device steps (a mesh's or a target's executables are not serialised).
        # One local device only: a deserialised executable loads onto every local device (a one-device program
        # restored in a process of 8 CPU devices then expects 8 shards of each argument).
        cache = executable_cache if target is None and mesh is None and jax.local_device_count() == 1 else None
        # The model as the step sees it: its config, dtype, parameter tree and graph (modules and static fields).
        model_key = (repr(getattr(model, "cfg", None)), str(getattr(model, "dtype", None)), str(self._param_treedef),
                     hashlib.sha256(repr(self.graphdef).encode()).hexdigest() if cache is not None else None)
        programs = {b: self._bucket_programs(b, wrap, abstract_caches, backend, ssm_working_set, cache, model_key)
                    for b in self.all_buckets}
        return programs, cache

    def _build(self, programs: dict[Bucket, list[Program]], first: tuple[Bucket, ...], cache, workers: int,
               defer_restores: bool = False) -> None:
        """Build ``first``'s programs now and the others' on a background thread (a lazy build), on ``workers``
        threads. ``defer_restores``: of ``first``'s programs, those whose cache entries read back whole are
        deserialised on a background thread instead (``BackgroundRestore``), the rest compiled now."""
        progress, target = self._progress, self.target
        #: Threads the programs were built on (``program_builder.default_workers`` unless ``max_workers``).
        self.build_workers = workers
        # Weak callbacks: the background threads must not keep a dropped engine (its executables, its caches).
        builder = ProgramBuilder(WeakCallback(self._compile_lowered), cache=cache, workers=self.build_workers,
                                 on_ready=WeakCallback(self._program_ready))
        if progress is not None:
            # JAX's persistent cache can be asked only by compiling: its programs count as compiled until in.
            progress.begin(self.num_programs_planned, sum(builder.cached(p) for ps in programs.values() for p in ps),
                           may_hit_jax_cache=target is None and bool(jax.config.jax_compilation_cache_dir)
                           and jax.config.jax_enable_compilation_cache)
        before, lowerings_before = _CompileCounter.count, _CompileCounter.lowerings
        now = [p for b in first for p in programs[b]]
        deferred, now = builder.read_cached(now) if defer_restores and cache is not None else ([], now)
        # (A GPU target compiles afresh, without JAX's persistent cache: aot.compile_lowered_for_target.)
        self.build_stats = builder.build(now)
        #: Backend compilations while building (any thread): 0 on a warm start that restored everything.
        self.startup_backend_compiles = _CompileCounter.count - before
        #: Lowerings (jaxpr -> StableHLO, any thread) while building: 0 on a warm start that restored everything.
        self.startup_lowerings = _CompileCounter.lowerings - lowerings_before
        rest = [p for b in self.all_buckets if b not in first for p in programs[b]]
        self._background: threading.Thread | None = None
        self._stop = threading.Event()
        if rest or deferred:
            stop_at_exit(self._stop)
            # An engine dropped while its programs build or restore: the threads end after the program at hand
            # instead of building the rest for nobody.
            weakref.finalize(self, self._stop.set)
        if rest:
            self._background = threading.Thread(target=self._build_rest, name="jaxmamba-lazy-compile",
                                                args=(weakref.ref(self), builder, rest, self._stop, progress))
            self._background.start()
        elif progress is not None:
            progress.close()
            self._progress = None  # (a background restore does not draw on a closed bar)
        #: The programs handed to the background restore (``restore="background"``), restored after the build.
        self._deferred = frozenset(program.key for program, _ in deferred)
        if deferred:
            self._restore = BackgroundRestore(builder, deferred, self._stop)
        self.backend_compiles_after_warmup_base = _CompileCounter.count - _CompileCounter.background

    def _weights(self) -> list:
        """The parameter leaves as the steps take them (``param_leaves``), once their layout copy is done."""
        future = self._weights_future
        if future is not None:
            self.param_leaves = future.result()
            self._weights_future = None
        return self.param_leaves

    def _flatten_params(self, model):
        """Flatten the model's parameters once (``param_leaves``; on the CPU in ``cpu_weight_layout``, under a
        mesh sharded by rank); return the wrapper of a step body (``shard_map`` under a mesh)."""
        mesh, target = self.mesh, self.target
        self._transposed: tuple[bool, ...] = ()  # leaves stored as (in, out): model.serving.cpu_weight_layout
        self._weights_future: Future | None = None  # param_leaves' layout copy, while it is made
        if mesh is None:
            self.graphdef, params = nnx.split(model)
            self.param_leaves, self._param_treedef = jax.tree_util.tree_flatten(params)
            # XLA CPU only (see cpu_weight_layout); GPU targets and meshes keep torch's orientation.
            if target is None and jax.default_backend() == "cpu":
                self._transposed = cpu_weight_layout(params)
                # The host copies of the transposed weights (~0.25 s for a 21M model) are made on a thread beside
                # the programs' restore or lowering: the programs are planned from the leaves' shapes, and
                # lowered and run with the copies (``_weights``).
                pool = ThreadPoolExecutor(1, thread_name_prefix="jaxmamba-weight-layout")
                self._weights_future = pool.submit(to_weight_layout, self.param_leaves, self._transposed)
                pool.shutdown(wait=False)
                self.param_leaves = to_weight_layout(
                    [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.param_leaves], self._transposed)
            return lambda body: body
        else:
            from jax.sharding import NamedSharding, PartitionSpec

            from jaxmamba import parallel

            self.graphdef, param_specs = parallel.local_graphdef(model.cfg, parallel.mesh_tp_size(mesh), model.dtype)
            self.param_leaves, self._param_treedef = jax.tree_util.tree_flatten(
                parallel.shard_params(model, model.cfg, mesh))
            param_specs = self._param_treedef.flatten_up_to(param_specs)
            cache_specs = parallel.cache_specs(model.cfg)
            replicated = PartitionSpec()
            self._replicated = NamedSharding(mesh, replicated)
            # check_vma=False: the reference kernels start loop carries from fresh (unvarying) zeros.
            return lambda body: jax.shard_map(
                body, mesh=mesh,
                in_specs=(param_specs, cache_specs, replicated, replicated, replicated, replicated, replicated),
                out_specs=(replicated, cache_specs), check_vma=False)

    def _bucket_programs(self, bucket: Bucket, wrap, abstract_caches, backend: str, ssm_working_set: bool, cache,
                         model_key) -> list[Program]:
        """The bucket's programs (one per sampling variant, and a window's per variant), not yet lowered."""
        mesh, target, layout = self.mesh, self.target, self.layouts[bucket]
        # A GPU target compiles the real Triton kernels, never the interpreter.
        opts = StepOptions(backend=backend, has_prefill=not bucket.decode_only,
                           interpret=False if target is not None else None)
        sharding = self._replicated if mesh is not None else None
        float_spec = jax.ShapeDtypeStruct((len(FLOAT_INPUTS) * bucket.num_reqs,), jnp.float32, sharding=sharding)
        blocks_per_req = dict(layout.separate)["block_table"][1]
        table_spec = jax.ShapeDtypeStruct((self.block_table_rows, blocks_per_req), jnp.int32, sharding=sharding)
        state_spec = jax.ShapeDtypeStruct((self.block_table_rows, self.state_table_columns), jnp.int32,
                                          sharding=sharding)
        prev_spec = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=sharding)
        multi = self.num_scheduler_steps > 1 and bucket.decode_only
        programs = []
        for variant, multi_step in itertools.product(self.sampling_variants[bucket], (False, True)[: 1 + multi]):
            common_args = dict(layout=layout, bucket=bucket, opts=opts, variant=variant, max_rows=self.max_rows,
                               transposed=self._transposed)
            if multi_step:
                body = functools.partial(_multi_step, self.graphdef, self._param_treedef,
                                         num_steps=self.num_scheduler_steps, ssm_working_set=ssm_working_set,
                                         **common_args)
            else:
                body = functools.partial(_step, self.graphdef, self._param_treedef, num_spec=self.num_spec,
                                         **common_args)
            int_spec = jax.ShapeDtypeStruct(
                (int_buffer_size(layout, bucket, self.num_spec, multi_step),), jnp.int32, sharding=sharding)
            args = (self.param_leaves, abstract_caches, int_spec, float_spec, table_spec, state_spec, prev_spec)
            fn = jax.jit(wrap(body), donate_argnums=(1,))
            if target is None:
                lower = functools.partial(WeakCallback(self._lower_with_weights), fn, args[1:])
            else:
                lower = functools.partial(aot.lower_for_target, fn, *args, target=target)
            lower = _under_precision(lower, self.matmul_precision)
            cache_key = None
            if cache is not None:
                specs = [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(args)]
                cache_key = cache.key(dict(
                    model=model_key, bucket=repr(bucket), variant=repr(variant), multi_step=multi_step,
                    layout=repr(layout), opts=repr(opts), num_spec=self.num_spec, max_rows=self.max_rows,
                    transposed=self._transposed, num_steps=self.num_scheduler_steps if multi_step else 1,
                    ssm_working_set=ssm_working_set, args=specs, caches=str(jax.tree_util.tree_structure(args)),
                    matmul_precision=self.matmul_precision))
            programs.append(Program((bucket, variant, multi_step), lower, cache_key))
        return programs

    def _lower_with_weights(self, fn, args_after_weights: tuple):
        """``fn.lower(weights, *args_after_weights)`` with the parameter leaves themselves (``_weights``)."""
        return fn.lower(self._weights(), *args_after_weights)

    def _first_buckets(self) -> tuple[Bucket, ...]:
        """What a lazy build compiles before serving: every pure-decode bucket and the largest mixed one (it
        holds any batch), so that every batch has a bucket from the first step on."""
        mixed = [b for b in self.all_buckets if not b.decode_only]
        return tuple(b for b in self.all_buckets if b.decode_only) + ((max(mixed),) if mixed else ())

    def _compile_lowered(self, lowered):
        """Backend-compile one lowered program (on a pool thread): ``(executable, (memory, kernels))``."""
        if self.target is None:
            # (JAX's persistent cache may answer: ProgramBuilder stores such an executable from its entry's bytes.)
            executable = lowered.compile()
            return executable, (MemoryStats.of(executable), ())
        result = aot.compile_lowered_for_target(lowered, self.target)
        return result.compiled, (result.memory, tuple(result.kernels))

    def _program_ready(self, program: Program, executable, extra, from_cache: bool) -> None:
        """Keep a built program; publish its bucket once all of the bucket's programs are in."""
        bucket, variant, multi_step = program.key
        memory, kernels = extra
        with self._lock:
            self._executables[program.key] = executable
            # The full tail is the largest: its temporaries bound the other variants' (a GPU target: FULL only).
            if variant == FULL:
                self._keep_largest(bucket, memory)
            if kernels:
                self.kernels[bucket] = self.kernels.get(bucket, ()) + tuple(kernels)
            complete = all((bucket, v, m) in self._executables for v in self.sampling_variants[bucket]
                           for m in (False, True)[: 1 + (self.num_scheduler_steps > 1 and bucket.decode_only)])
            if complete:
                self._ready = tuple(sorted(self._ready + (bucket,)))
        if self._progress is not None:
            self._progress.update(from_cache=from_cache)
        if complete and self._on_compiled is not None:
            self._on_compiled(bucket)

    @staticmethod
    def _build_rest(owner: weakref.ref, builder: ProgramBuilder, programs: list[Program], stop: threading.Event,
                    progress) -> None:
        """The lazy build's background part (its backend compiles are not counted as serving's). ``owner``: a
        weak reference to the ``CompiledSteps``, so that the thread does not keep a dropped engine alive."""
        try:
            stats = builder.build(programs, stop=stop)
        except OwnerGone:
            return  # dropped while a program was lowered, compiled or handed in
        finally:
            if progress is not None:
                progress.close()
        steps = owner()
        if steps is not None:
            with steps._lock:
                steps.build_stats.add(stats)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every program is built (a lazy build's background part, a background restore); False
        on timeout. ``build_stats`` then counts the background restore's programs too; a restore that ended
        without some program raises (``BackgroundRestore.wait``'s ``RuntimeError``)."""
        if self._background is not None:
            self._background.join(timeout)
            if self._background.is_alive():
                return False
        restore = self._restore
        if restore is not None:
            if not restore.join(timeout):
                return False
            for key in self._deferred.difference(self._executables):
                restore.wait(key)  # the thread has ended: raises, naming the program and chaining the failure
            with self._lock:
                if self._restore is restore:
                    self.build_stats.add(restore.stats)
                    self._restore = None
        return True

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets a batch may take, smallest first: those whose programs are built (all of them after an
        eager build), and while a background restore runs every bucket (a step waits for its program)."""
        return self.all_buckets if self._restore is not None else self._ready

    def _program(self, key: tuple):
        """The executable of ``key`` (``(bucket, variant, multi_step)``), waiting for it while it restores."""
        executable = self._executables.get(key)
        if executable is None:
            restore = self._restore
            if restore is not None:
                restore.wait(key)
            executable = self._executables[key]
        return executable

    @property
    def num_deferred_restores(self) -> int:
        """Programs handed to the background restore at construction (``restore="background"``)."""
        return len(self._deferred)

    @property
    def programs_restored(self) -> int:
        """Programs restored from the executable cache so far, a background restore's included."""
        with self._lock:
            restore = self._restore
            return self.build_stats.num_restored + (restore.stats.num_restored if restore is not None else 0)

    @property
    def programs_ready(self) -> int:
        return len(self._executables)

    @property
    def num_compilations(self) -> int:
        """Step programs the build provided: compiled or restored from the executable cache, those a background
        restore still deserialises included (``programs_ready`` counts the ones in)."""
        with self._lock:
            return len(self._deferred.union(self._executables))

    def _keep_largest(self, bucket: Bucket, memory: MemoryStats) -> None:
        """A bucket's memory is its hungriest program's (the one step or the window of steps)."""
        if bucket not in self.memory or memory.temp_bytes > self.memory[bucket].temp_bytes:
            self.memory[bucket] = memory

    def num_programs(self, bucket: Bucket) -> int:
        """Programs compiled for ``bucket``: one per sampling variant, and a window's per variant too."""
        return sum(key[0] == bucket for key in self._executables)

    def executable(self, bucket: Bucket, variant: SamplingVariant | None = None, multi_step: bool = False):
        """The compiled program of ``bucket`` (default: its largest sampling tail, ``FULL`` where compiled);
        ``as_text()`` gives its optimized HLO (``jaxmamba.hlo_traffic``)."""
        variants = self.sampling_variants[bucket]
        return self._program((bucket, variant if variant is not None else
                              (FULL if FULL in variants else variants[-1]), multi_step))

    def has_window(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` has a multi-step program (``num_scheduler_steps`` > 1, pure-decode buckets)."""
        return (bucket, self.sampling_variants[bucket][0], True) in self.cache_keys

    @property
    def backend_compiles_since_warmup(self) -> int:
        """Backend compilations since the build (a lazy build's background compiles excluded): serving's."""
        return _CompileCounter.count - _CompileCounter.background - self.backend_compiles_after_warmup_base

    def dispatch(self, bucket: Bucket, caches: StateCaches, int_buf: np.ndarray, float_buf: np.ndarray,
                 block_table: jax.Array, state_table: jax.Array, prev_last_tokens: jax.Array | None = None,
                 profile: HostProfile | None = None, variant: SamplingVariant = FULL, multi_step: bool = False):
        """Enqueue one step with ``variant``'s sampling tail (one of ``self.sampling_variants[bucket]``) and
        return at once: ``(outputs, caches)``, device arrays (``read`` brings the outputs to the host).
        ``caches`` is donated (do not reuse it); ``block_table`` is the persistent device table
        (``int32[block_table_rows, B]``, read only; replicated under a mesh), ``state_table`` the persistent
        Mamba state-index table (``int32[block_table_rows, state_table_columns]``, likewise). ``prev_last_tokens``: the
        previous step's ``last_tokens`` output (``outputs[-1]``), read where ``int_buf``'s ``prev_token_rows``
        point (default: zeros, for a step whose rows all know their tokens). ``profile`` times the transfer
        and dispatch phases and tracks the step's device time. ``multi_step``: run the bucket's multi-step
        program (``int_buf`` then ends with ``num_steps``; ``num_scheduler_steps`` > 1, pure-decode buckets)."""
        if self.target is not None:
            raise ConfigError(f"these steps were compiled for the {self.target} target, which cannot run here")
        if prev_last_tokens is None:
            prev_last_tokens = self._no_prev_tokens()
        program = self._program((bucket, variant, multi_step))
        with maybe_phase(profile, "transfer"):
            inputs = call_arguments((int_buf, float_buf), self._replicated if self.mesh is not None else None)
        start = time.perf_counter()
        with maybe_phase(profile, "dispatch"):
            outputs, caches = program(
                self.param_leaves, caches, *inputs, block_table, state_table, prev_last_tokens)
        if profile is not None:
            profile.track_device(outputs[-1], start)
        return outputs, caches

    def _no_prev_tokens(self) -> jax.Array:
        if self._zeros_prev is None:
            self._zeros_prev = device_put_global(np.zeros(self.max_rows, np.int32),
                                                 self._replicated if self.mesh is not None else None)
        return self._zeros_prev

    @staticmethod
    def read(outputs, profile: HostProfile | None = None, logprobs: bool = True):
        """The six ``verify_and_sample`` outputs of a dispatched step as numpy arrays (``None`` for those its
        variant does not compute), blocking until the step is done (``profile``: the ``wait`` phase, then
        ``read_back``). ``logprobs=False``: no row asked for logprobs, so only the sampled ids and the
        accepted counts come back (the four logprob outputs read as ``None``)."""
        samples = outputs[:-1] if logprobs else outputs[:2]  # last_tokens stays on the device, for the next step
        if profile is not None:
            with profile.phase("wait"):
                jax.block_until_ready(samples)
        with maybe_phase(profile, "read_back"):
            # Each ready array converted by itself: ``jax.device_get``'s tree walk and per-leaf copy calls cost
            # about ten times more host time for these few small outputs (docs/architecture.md, "Read back").
            host = [None if a is None else np.asarray(a) for a in samples]
        return tuple(host) if logprobs else (*host, None, None, None, None)

    def run(self, bucket: Bucket, caches: StateCaches, int_buf: np.ndarray, float_buf: np.ndarray,
            block_table: jax.Array, state_table: jax.Array, profile: HostProfile | None = None,
            variant: SamplingVariant = FULL, multi_step: bool = False, read_logprobs: bool = True):
        """``dispatch`` then ``read``: one synchronous step. Returns ``(outputs, caches)``: the six
        ``verify_and_sample`` outputs as numpy arrays, the new caches (``caches`` is donated).
        ``read_logprobs``: ``read``'s ``logprobs``."""
        outputs, caches = self.dispatch(bucket, caches, int_buf, float_buf, block_table, state_table, None, profile,
                                        variant, multi_step)
        return self.read(outputs, profile, read_logprobs), caches
