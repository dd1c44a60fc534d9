"""Jit-compiled steps over static buckets: our analogue of vLLM's full CUDA graphs.

A bucket is ``(num_reqs_padded, num_tokens_padded)``, whether it is a
pure-decode bucket, and for a mixed bucket how many prefill rows it holds. ``CompiledSteps`` lowers and
compiles one executable per bucket and sampling variant (``jaxmamba.sampling.SamplingVariant``:
greedy-only batches skip the sort, the random draws and the logprobs; ``bucket_sampling_variants``
says which buckets get which) ahead of time (``.lower().compile()``), caches donated; serving then
only calls those executables, which refuse any other shape, so a batch can never trigger a
compilation. ``num_compilations`` counts the step compilations, and a
``jax.monitoring`` listener counts every backend compilation in the process so
tests can prove nothing else compiled while serving.

Per step the host sends two arrays: ``int_buf`` (one int32 transfer: the packed
metadata, then ``int_input_sizes``' fields) and ``float_buf`` (temperature, top-p, min-p).
The attention block table is a persistent device array (``engine.block_table.DeviceBlockTable``,
``int32[block_table_rows, cdiv(max_model_len, block_size)]``, updated in place by the entries that
changed): the step reads it, never takes it, and its attention kernels read batch row ``r``'s
block ids at row ``row_map[r]`` (``int_buf``'s ``row_map`` field) in place. The Mamba state-index
table (``int32[block_table_rows, mamba_block_table_columns]``) persists the same way, on the same rows:
the step gathers its per-row slot arrays from it (``metadata.device_slots``), so ``int_buf`` carries
only the block-index columns they are read at.
A third input, ``prev_last_tokens`` (``int32[max_rows]``), is the previous step's
``last_tokens`` output left on the device: under async scheduling a row whose last input
token was sampled by the previous step (not yet read back) names that step's batch row in
``int_buf``'s ``prev_token_rows`` and the step takes the token from there.

The parameters are flattened once, at construction: each call passes the flat
leaf list, and the step rebuilds the model from it at trace time. Flattening the NNX
state on every call cost ~0.7 us per variable (an 81-variable model: 89 vs 34 us per
call on the CPU; an 8B hybrid has ~311).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba import aot
from jaxmamba.aot import KernelStats, MemoryStats
from jaxmamba.cache import StateCaches
from jaxmamba.host_profile import HostProfile, maybe_phase
from jaxmamba.errors import ConfigError, MetadataError
from jaxmamba.metadata import PackLayout, unpack
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS, gather_slot_indices
from jaxmamba.model.serving import StepOptions, cpu_weight_layout, forward_step, from_weight_layout, to_weight_layout
from jaxmamba.sampling import FULL, GREEDY, MAX_BANNED_IDS, MAX_LOGPROBS, SamplingVariant, verify_and_sample


@dataclass(frozen=True, order=True)
class Bucket:
    """Static shapes of one compiled step.

    ``num_prefills`` (``P``) sizes the Mamba prefill path: the SSD chunk arrays, the gathered
    initial/final states and the varlen-conv rows follow the prefill rows a bucket holds, not its
    request rows (a mixed step of 250 decodes and 2 prompt chunks needs 2 rows of SSD state, not
    256). ``None`` means every row (``P = R``); decode buckets have ``P = 0``.
    """

    num_tokens: int  # T: padded tokens (sorted first: the smallest bucket that fits wins)
    num_reqs: int  # R: padded rows
    decode_only: bool = False
    num_prefills: int | None = None  # P: prefill rows (mixed buckets)

    def __post_init__(self):
        if self.decode_only:
            p = 0
        else:
            p = self.num_reqs if self.num_prefills is None else int(self.num_prefills)
            if not 1 <= p <= self.num_reqs:
                raise ConfigError(f"a mixed bucket's num_prefills={p} must be in [1, num_reqs={self.num_reqs}]")
        object.__setattr__(self, "num_prefills", p)

    def fits(self, num_reqs: int, num_tokens: int, num_prefills: int = 0) -> bool:
        return num_reqs <= self.num_reqs and num_tokens <= self.num_tokens and num_prefills <= self.num_prefills


def _pow2_upto(n: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v < n:
        out.append(v)
        v *= 2
    return out + [n]


def prefill_rows_ladder(num_reqs: int) -> list[int]:
    """Prefill-row counts ``P`` of the mixed buckets with ``R = num_reqs`` rows: ``R`` itself (a burst
    of new prompts) and 4, 32 where ``R`` is at least 4x larger (the steady state of continuous
    batching: many decodes, a few prompt chunks). Few rungs: every bucket is one more compile."""
    return sorted({p for p in (4, 32) if 4 * p <= num_reqs} | {num_reqs})


def default_buckets(max_num_seqs: int, max_num_batched_tokens: int, num_spec: int = 0) -> tuple[Bucket, ...]:
    """Pure-decode buckets for ``R = 1, 2, 4, ..., max_num_seqs``; mixed buckets for
    ``T = 16, 32, ..., max_num_batched_tokens`` at ``R = max_num_seqs`` and, where fewer, at ``R = T``
    (a mixed batch of ``T`` tokens has at most ``T`` rows), each at the prefill-row counts of
    ``prefill_rows_ladder(R)``: a small mixed step does not carry ``max_num_seqs`` rows of per-row
    arrays, nor a mostly-decode step ``R`` rows of SSD chunks and states."""
    per_row = 1 + num_spec
    decode = [Bucket(r * per_row, r, True) for r in _pow2_upto(max_num_seqs)]
    mixed = [Bucket(t, r, False, p) for t in _pow2_upto(max_num_batched_tokens, 16)
             for r in {min(t, max_num_seqs), max_num_seqs} for p in prefill_rows_ladder(r)]
    return tuple(sorted(set(decode + mixed)))


def engine_buckets(max_num_seqs: int, max_num_batched_tokens: int, num_spec: int = 0,
                   buckets=None) -> tuple[Bucket, ...]:
    """The engine's bucket set: ``default_buckets``, or explicit mixed buckets as ``(num_reqs, num_tokens)``
    pairs (every row may be a prefill) or ``(num_reqs, num_tokens, num_prefills)`` triples; one of them
    must hold ``max_num_seqs`` rows, all of them prefills, and ``max_num_batched_tokens`` tokens."""
    if buckets is None:
        return default_buckets(max_num_seqs, max_num_batched_tokens, num_spec)
    bucket_set = []
    for entry in buckets:
        try:
            r, t, *p = (int(v) for v in entry)
            if len(p) > 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"bucket {entry!r} must be (num_reqs, num_tokens) or (num_reqs, num_tokens, "
                              "num_prefills)") from None
        bucket_set.append(Bucket(t, r, False, p[0] if p else None))
    bucket_set = tuple(sorted(set(bucket_set)))
    if not any(b.fits(max_num_seqs, max_num_batched_tokens, max_num_seqs) for b in bucket_set):
        raise ConfigError("buckets must include one holding max_num_seqs rows (all prefills) and "
                          "max_num_batched_tokens tokens")
    return bucket_set


def select_bucket(buckets: tuple[Bucket, ...], num_reqs: int, num_tokens: int, decode_only: bool,
                  num_prefills: int | None = None) -> Bucket:
    """The smallest bucket holding the batch. A decode-only batch takes a decode bucket whenever one
    holds it (a mixed bucket of the same size would run the prefill kernels for nothing); mixed
    batches take mixed buckets with room for their ``num_prefills`` prefill rows (default: every row)."""
    need_p = 0 if decode_only else (num_reqs if num_prefills is None else num_prefills)
    fitting = [b for b in buckets if b.fits(num_reqs, num_tokens, need_p) and (decode_only or not b.decode_only)]
    if fitting:
        # Bucket's own order puts decode_only=False first on equal sizes: rank decode buckets first.
        return min(fitting, key=lambda b: (not b.decode_only, b.num_tokens, b.num_reqs, b.num_prefills))
    raise MetadataError(f"no bucket holds {num_reqs} requests ({need_p} prefills) / {num_tokens} tokens "
                        f"(buckets: {buckets})")


#: Engine arg ``sampling_variants``: which buckets also get the greedy-only sampling tail.
#: "auto": pure-decode buckets and mixed buckets of at least ``GREEDY_TAIL_MIN_ROWS`` rows; "decode": pure-decode
#: buckets only (where the tail is a large share of a step); "all": every bucket; "full": none (one program
#: per bucket, the fewest compilations).
SAMPLING_VARIANT_POLICIES = ("auto", "decode", "all", "full")

#: Rows from which a mixed bucket gets the greedy tail under "auto": the full tail sorts the vocabulary of
#: every row, which at 256 rows cost a greedy workload more than its prefill (bench serve on the tiny default:
#: 3,641 output tok/s with the full tail on mixed steps, 9,670 with the greedy one); small engines (the tests,
#: notebooks) keep one program per mixed bucket.
GREEDY_TAIL_MIN_ROWS = 32


def check_sampling_variants(policy: str) -> None:
    """Raise ``ConfigError`` unless ``policy`` is one of ``SAMPLING_VARIANT_POLICIES``."""
    if policy not in SAMPLING_VARIANT_POLICIES:
        raise ConfigError(f"sampling_variants={policy!r} must be one of {SAMPLING_VARIANT_POLICIES}")


def bucket_sampling_variants(bucket: Bucket, policy: str = "auto") -> tuple[SamplingVariant, ...]:
    """The sampling variants compiled for ``bucket`` under ``policy``, cheapest first (``FULL`` always)."""
    check_sampling_variants(policy)
    greedy = (policy == "all" or (policy in ("auto", "decode") and bucket.decode_only)
              or (policy == "auto" and bucket.num_reqs >= GREEDY_TAIL_MIN_ROWS))
    return (GREEDY, FULL) if greedy else (FULL,)


class _CompileCounter:
    """Counts backend compilations process-wide through jax.monitoring."""

    _lock = threading.Lock()
    count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration: float, **kwargs) -> None:
                if event == "/jax/core/compile/backend_compile_duration":
                    cls.count += 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True


def int_input_sizes(bucket: Bucket, num_spec: int) -> dict[str, int]:
    """Fields that follow the packed metadata in ``int_buf``, in order, with their sizes."""
    r, s = bucket.num_reqs, 1 + num_spec
    return {"token_ids": bucket.num_tokens, "top_k": r, "seeds": r, "steps": r, "num_drafts": r,
            "drafts": r * num_spec, "logit_positions": r * s, "min_tokens": r, "ban_ids": r * MAX_BANNED_IDS,
            "prev_token_rows": r, "row_map": r}


#: Per-row floats of ``float_buf``, in order.
FLOAT_INPUTS = ("temperature", "top_p", "min_p")


def int_buffer_size(layout: PackLayout, bucket: Bucket, num_spec: int = 0) -> int:
    return layout.size + sum(int_input_sizes(bucket, num_spec).values())


def _step(graphdef, param_treedef, param_leaves, caches: StateCaches, int_buf, float_buf, block_table,
          state_table, prev_last_tokens, *, layout: PackLayout, bucket: Bucket, num_spec: int, opts: StepOptions,
          variant: SamplingVariant, max_rows: int, transposed: tuple[bool, ...] = ()):
    """One step: ``verify_and_sample``'s six outputs plus ``last_tokens`` (``int32[max_rows]``: each batch
    row's last accepted token, zero-padded; the next step's ``prev_last_tokens``), and the new caches.
    ``transposed``: which parameter leaves arrive as ``(in, out)`` (``cpu_weight_layout``)."""
    param_leaves = from_weight_layout(param_leaves, transposed)
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(param_treedef, param_leaves))
    r, s = bucket.num_reqs, 1 + num_spec
    fields, offset = {}, layout.size
    for name, size in int_input_sizes(bucket, num_spec).items():
        fields[name] = int_buf[offset : offset + size]
        offset += size
    # block_table: the persistent int32[N, B] table, read in place by the attention kernels at row row_map[r]
    # for batch row r (padding rows: the null row). Gathering the [R, B] table the metadata describes would
    # make a step temporary as wide as max_model_len; unpack gets a placeholder of that shape, never computed.
    # The Mamba slot arrays packed apart are gathered from the persistent state table (state_table, int32[N, C])
    # at the same rows; their placeholders are replaced.
    separate = dict(layout.separate)
    common, mamba = unpack(int_buf[: layout.size], layout,
                           **{name: jnp.zeros(shape, jnp.int32) for name, shape in separate.items()})
    common = dataclasses.replace(common, block_table=block_table)
    if DEVICE_SLOT_FIELDS[0] in separate:
        mamba = gather_slot_indices(mamba, state_table, fields["row_map"])
    temperature, top_p, min_p = (float_buf[i * r : (i + 1) * r] for i in range(len(FLOAT_INPUTS)))
    logit_positions = fields["logit_positions"].reshape(r, s)
    # A row's last input token may still be on the device (async scheduling): the previous step sampled
    # it. Its position is the row's last scheduled token, which is where the row's last logit is read.
    prev_rows = fields["prev_token_rows"]
    target = jnp.where(prev_rows >= 0, logit_positions[:, -1], bucket.num_tokens)  # out of range: dropped
    token_ids = fields["token_ids"].at[target].set(prev_last_tokens[jnp.clip(prev_rows, 0, max_rows - 1)],
                                                   mode="drop")
    logits, caches = forward_step(model, caches, common, mamba, token_ids, logit_positions, opts,
                                  block_table_rows=fields["row_map"])
    outputs = verify_and_sample(
        logits, fields["drafts"].reshape(r, num_spec), fields["num_drafts"], temperature, fields["top_k"], top_p,
        fields["seeds"], fields["steps"], min(MAX_LOGPROBS, logits.shape[-1]), min_p=min_p,
        min_tokens=fields["min_tokens"], ban_ids=fields["ban_ids"].reshape(r, MAX_BANNED_IDS), variant=variant)
    tokens, num_accepted = outputs[0], outputs[1]
    last = jnp.take_along_axis(tokens, num_accepted[:, None], axis=1)[:, 0]
    # A pad, not zeros().at[:r].set(): jax 0.11.2's CPU compiler segfaulted on that update inside the TP
    # shard_map (bisected to the commit that added last_tokens; every TP engine test crashed).
    last_tokens = jnp.pad(last.astype(jnp.int32), (0, max_rows - r))
    return (*outputs, last_tokens), caches


class CompiledSteps:
    """One AOT-compiled executable per bucket and sampling variant; ``run`` never compiles."""

    def __init__(self, model, caches: StateCaches, buckets: tuple[Bucket, ...], layouts: dict[Bucket, PackLayout],
                 *, backend: str = "reference", num_spec: int = 0, mesh=None, target: str | None = None,
                 on_compiled=None, sampling_variants: str = "auto", block_table_rows: int | None = None,
                 state_table_columns: int = 1):
        """``block_table_rows``: rows of the persistent block table each step reads (default: the largest
        bucket's rows plus the null row, as ``ModelRunner`` allocates it). ``state_table_columns``: columns of
        the persistent Mamba state-index table (same rows), from which steps whose layouts pack
        ``metadata.device_slots.DEVICE_SLOT_FIELDS`` apart gather them (``mamba_block_table_columns``).

        ``mesh``: a ``jaxmamba.parallel`` mesh for tensor parallelism. Each device then runs the
        step on its own vLLM rank shard (weights in rank order, caches in vLLM's per-rank pages)
        inside one ``shard_map``; sampling runs identically on every rank from the gathered logits.

        ``target``: a GPU target of ``jaxmamba.aot`` (``"h100"``): compile every bucket for that device
        without one (model and caches may then be abstract, ``ShapeDtypeStruct`` leaves); the
        executables cannot run, but ``memory`` and ``kernels`` hold what the device would use.
        ``on_compiled(bucket)`` is called after each bucket compiles (progress bars).

        ``sampling_variants``: a policy of ``bucket_sampling_variants``; ``self.sampling_variants[bucket]``
        lists the bucket's compiled variants. A GPU target compiles ``FULL`` only: its memory bounds
        every variant's, and target executables never run.
        """
        _CompileCounter.install()
        if target is not None and mesh is not None:
            raise ConfigError("compiling for a GPU target is single-device: tensor_parallel_size must be 1")
        self.mesh = mesh
        self.target = target
        self._transposed: tuple[bool, ...] = ()  # leaves stored as (in, out): model.serving.cpu_weight_layout
        if mesh is None:
            self.graphdef, params = nnx.split(model)
            self.param_leaves, self._param_treedef = jax.tree_util.tree_flatten(params)
            # XLA CPU only (see cpu_weight_layout); GPU targets and meshes keep torch's orientation.
            if target is None and jax.default_backend() == "cpu":
                self._transposed = cpu_weight_layout(params)
                self.param_leaves = to_weight_layout(self.param_leaves, self._transposed)
            wrap = lambda body: body  # noqa: E731
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
            wrap = lambda body: jax.shard_map(  # noqa: E731
                body, mesh=mesh,
                in_specs=(param_specs, cache_specs, replicated, replicated, replicated, replicated, replicated),
                out_specs=(replicated, cache_specs), check_vma=False)
        self.buckets = tuple(sorted(buckets))
        self.layouts = layouts
        self.max_rows = max(b.num_reqs for b in self.buckets)
        self._zeros_prev = None  # prev_last_tokens of a step whose rows know all their tokens
        self.block_table_rows = self.max_rows + 1 if block_table_rows is None else block_table_rows
        self.state_table_columns = state_table_columns
        self.num_spec = num_spec
        self.sampling_variants: dict[Bucket, tuple[SamplingVariant, ...]] = {
            b: (FULL,) if target is not None else bucket_sampling_variants(b, sampling_variants) for b in self.buckets}
        self.num_compilations = 0
        self._executables: dict[tuple[Bucket, SamplingVariant], object] = {}
        self.memory: dict[Bucket, MemoryStats] = {}  # XLA's buffer assignment of each bucket's executable
        self.kernels: dict[Bucket, tuple[KernelStats, ...]] = {}  # per bucket, target compiles only
        # Caches keep their shardings: otherwise a TP step would expect them replicated.
        abstract_caches = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if mesh is not None else None), caches)
        for bucket in self.buckets:
            # A GPU target compiles the real Triton kernels, never the interpreter.
            opts = StepOptions(backend=backend, has_prefill=not bucket.decode_only,
                               interpret=False if target is not None else None)
            sharding = self._replicated if mesh is not None else None
            int_spec = jax.ShapeDtypeStruct((int_buffer_size(layouts[bucket], bucket, num_spec),), jnp.int32,
                                            sharding=sharding)
            float_spec = jax.ShapeDtypeStruct((len(FLOAT_INPUTS) * bucket.num_reqs,), jnp.float32, sharding=sharding)
            blocks_per_req = dict(layouts[bucket].separate)["block_table"][1]
            table_spec = jax.ShapeDtypeStruct((self.block_table_rows, blocks_per_req), jnp.int32, sharding=sharding)
            state_spec = jax.ShapeDtypeStruct((self.block_table_rows, state_table_columns), jnp.int32,
                                              sharding=sharding)
            prev_spec = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=sharding)
            for variant in self.sampling_variants[bucket]:
                body = functools.partial(_step, self.graphdef, self._param_treedef, layout=layouts[bucket],
                                         bucket=bucket, num_spec=num_spec, opts=opts, variant=variant,
                                         max_rows=self.max_rows, transposed=self._transposed)
                fn = jax.jit(wrap(body), donate_argnums=(1,))
                if target is None:
                    executable = fn.lower(self.param_leaves, abstract_caches, int_spec, float_spec,
                                          table_spec, state_spec, prev_spec).compile()
                    if variant == FULL:  # the largest tail: its temporaries bound the other variants'
                        self.memory[bucket] = MemoryStats.of(executable)
                else:
                    result = aot.compile_for_target(fn, self.param_leaves, abstract_caches, int_spec, float_spec,
                                                    table_spec, state_spec, prev_spec, target=target)
                    executable = result.compiled
                    self.memory[bucket], self.kernels[bucket] = result.memory, result.kernels
                self._executables[bucket, variant] = executable
                self.num_compilations += 1
            if on_compiled is not None:
                on_compiled(bucket)
        self.backend_compiles_after_warmup_base = _CompileCounter.count

    @property
    def backend_compiles_since_warmup(self) -> int:
        return _CompileCounter.count - self.backend_compiles_after_warmup_base

    def dispatch(self, bucket: Bucket, caches: StateCaches, int_buf: np.ndarray, float_buf: np.ndarray,
                 block_table: jax.Array, state_table: jax.Array, prev_last_tokens: jax.Array | None = None,
                 profile: HostProfile | None = None, variant: SamplingVariant = FULL):
        """Enqueue one step with ``variant``'s sampling tail (one of ``self.sampling_variants[bucket]``) and
        return at once: ``(outputs, caches)``, device arrays (``read`` brings the outputs to the host).
        ``caches`` is donated (do not reuse it); ``block_table`` is the persistent device table
        (``int32[block_table_rows, B]``, read only; replicated under a mesh), ``state_table`` the persistent
        Mamba state-index table (``int32[block_table_rows, state_table_columns]``, likewise). ``prev_last_tokens``: the
        previous step's ``last_tokens`` output (``outputs[-1]``), read where ``int_buf``'s ``prev_token_rows``
        point (default: zeros, for a step whose rows all know their tokens). ``profile`` times the transfer
        and dispatch phases and tracks the step's device time."""
        if self.target is not None:
            raise ConfigError(f"these steps were compiled for the {self.target} target, which cannot run here")
        if prev_last_tokens is None:
            prev_last_tokens = self._no_prev_tokens()
        with maybe_phase(profile, "transfer"):
            inputs = jax.device_put((int_buf, float_buf), self._replicated if self.mesh is not None else None)
        start = time.perf_counter()
        with maybe_phase(profile, "dispatch"):
            outputs, caches = self._executables[bucket, variant](self.param_leaves, caches, *inputs, block_table,
                                                                 state_table, prev_last_tokens)
        if profile is not None:
            profile.track_device(outputs[-1], start)
        return outputs, caches

    def _no_prev_tokens(self) -> jax.Array:
        if self._zeros_prev is None:
            self._zeros_prev = jax.device_put(np.zeros(self.max_rows, np.int32),
                                              self._replicated if self.mesh is not None else None)
        return self._zeros_prev

    @staticmethod
    def read(outputs, profile: HostProfile | None = None):
        """The six ``verify_and_sample`` outputs of a dispatched step as numpy arrays (``None`` for those its
        variant does not compute), blocking until the step is done (``profile``: the ``wait`` phase, then
        ``read_back``)."""
        samples = outputs[:-1]  # last_tokens stays on the device, for the next step
        if profile is not None:
            with profile.phase("wait"):
                jax.block_until_ready(samples)
        with maybe_phase(profile, "read_back"):
            return jax.device_get(samples)

    def run(self, bucket: Bucket, caches: StateCaches, int_buf: np.ndarray, float_buf: np.ndarray,
            block_table: jax.Array, state_table: jax.Array, profile: HostProfile | None = None,
            variant: SamplingVariant = FULL):
        """``dispatch`` then ``read``: one synchronous step. Returns ``(outputs, caches)``: the six
        ``verify_and_sample`` outputs as numpy arrays, the new caches (``caches`` is donated)."""
        outputs, caches = self.dispatch(bucket, caches, int_buf, float_buf, block_table, state_table, None, profile,
                                        variant)
        return self.read(outputs, profile), caches
