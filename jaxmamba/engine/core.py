"""``EngineCore``: the scheduler, the runner, the caches and the step loop, built from an ``EngineConfig``
(vLLM v1's ``EngineCore``). ``LLMEngine`` owns one; ``LLM`` and ``AsyncLLM`` reach it through that."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from jaxmamba import parallel
from jaxmamba.buckets import engine_buckets
from jaxmamba.cache import allocate_caches
from jaxmamba import compile_cache
from jaxmamba.compile_cache import CompileCounter, enable_compile_cache
from jaxmamba.compile_progress import attached_to_terminal
from jaxmamba.engine.engine_args import EngineConfig
from jaxmamba.engine.outputs import completion_output, output_text
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.request import (CompletionOutput, Request, RequestOutput, SamplingParams, check_utf8,
                                     device_seed, is_int)
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import Scheduler, cdiv
from jaxmamba.engine.spec_decode import make_proposer
from jaxmamba.engine.stats import EngineStats, StartupTimes
from jaxmamba.engine.step_loop import StepLoop
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.host_profile import HostProfile, maybe_step
from jaxmamba.parallel import distributed
from jaxmamba.engine.sizing import GIB, gpu_cache_budget, size_pools
from jaxmamba.sampling import MAX_BANNED_IDS
from jaxmamba.weights import load_pretrained, with_dt_clamp


class EngineCore:
    """The engine: ``EngineCore(model, config)``, ``model`` a checkpoint directory (HF or orbax) or a loaded
    ``HybridForCausalLM``. Its request API works on engine ``Request``s (one sample each): ``add_request``,
    ``step()`` (the requests that finished), ``abort_request``; ``LLMEngine`` builds vLLM's request API
    (caller ids, ``n`` samples, ``RequestOutput``s) on top, and in-tree drivers such as P/D disaggregation
    use this one. Construction loads the weights, sizes and allocates the pools, and builds the step
    programs (``startup_times`` says where the time went).

    ``devices``: the devices this engine runs on (default: the first ``tensor_parallel_size`` of
    ``jax.devices()``). A data-parallel replica (``engine.data_parallel``) gets its own disjoint set; given,
    the engine runs over a mesh of them even at ``tensor_parallel_size=1``, so that every array it places is
    committed to its replica's device rather than to the default one."""

    def __init__(self, model, config: EngineConfig | None = None, *, devices=None):
        started = time.perf_counter()
        self.config = config = config if config is not None else EngineConfig()
        self.devices = None if devices is None else list(devices)
        if self.devices is not None and len(self.devices) != config.tensor_parallel_size:
            raise ConfigError(f"{len(self.devices)} devices given for tensor_parallel_size="
                              f"{config.tensor_parallel_size}: an engine runs on exactly its TP ranks' devices")
        self.startup_times = StartupTimes()
        CompileCounter.install()
        compiles_before, lowerings_before = CompileCounter.count, CompileCounter.lowerings
        t0 = time.perf_counter()
        self.compile_cache_dir = enable_compile_cache(config.compile_cache)
        # Looked up on the module: the tests (and a user) can swap the cache policy there.
        executable_cache = compile_cache.executable_cache_for(self.compile_cache_dir, config.executable_cache)
        self.startup_times.cache_setup_s += time.perf_counter() - t0
        # A replica's weights load onto its own first device: on the default one they would land beside another
        # replica's full pools (a GPU out of memory) before moving to this replica's mesh.
        with jax.default_device(self.devices[0]) if self.devices else contextlib.nullcontext():
            self.checkpoint, self.model = self._load_model(model)
        self.cfg, self.dtype = self.model.cfg, self.model.dtype
        self.max_model_len = self._resolve_max_model_len()
        self.block_size = config.block_size
        proposer, num_spec = self._make_proposer()
        bucket_set = engine_buckets(config.max_num_seqs, config.max_num_batched_tokens, num_spec, config.buckets)
        if config.num_scheduler_steps > 1 and not any(b.decode_only for b in bucket_set):
            raise ConfigError(f"num_scheduler_steps={config.num_scheduler_steps} runs its windows in pure-decode "
                              "buckets; the buckets given are all mixed (leave buckets unset)")
        caches, shapes = self._allocate_pools(bucket_set, num_spec, executable_cache)
        self.runner = self._build_runner(shapes, bucket_set, num_spec, executable_cache)
        if isinstance(caches, Future):  # allocated beside the build: the runner had their shapes only
            t0 = time.perf_counter()
            self.runner.attach_caches(caches.result())
            self.startup_times.cache_setup_s += time.perf_counter() - t0
        self._stats = EngineStats(num_buckets=len(bucket_set), num_compilations=self.runner.steps.num_compilations,
                                  num_step_programs=self.runner.steps.num_programs_planned)
        self._record_build_times()
        self._seeds = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.tokenizer = load_tokenizer(self.checkpoint)
        self.step_loop = StepLoop(self.scheduler, self.runner, self.kv, cfg=self.cfg, tokenizer=self.tokenizer,
                                  stats=self._stats, proposer=proposer,
                                  num_spec=num_spec, async_scheduling=config.async_scheduling,
                                  num_scheduler_steps=config.num_scheduler_steps)
        if distributed.is_multi_process():
            self.step_loop.on_step_failure = distributed.step_failed
            self.runner.watchdog = distributed.StepWatchdog(config.distributed_timeout_s)
        # Serving across processes: process 0's engine.multiprocess.Leader, told of every command and step.
        self.replicator = None
        self.startup_times.total_s = time.perf_counter() - started
        self.startup_times.total_backend_compiles = CompileCounter.count - compiles_before
        self.startup_times.total_lowerings = CompileCounter.lowerings - lowerings_before

    # ------------------------------------------------------------------ construction
    def _load_model(self, model):
        """``(checkpoint directory or None, the model with its dt clamp)``: loads ``model`` if it is a path."""
        dtype, checkpoint = self.config.dtype, None
        if isinstance(model, (str, Path)):
            checkpoint = Path(model)
            t0 = time.perf_counter()
            model = load_pretrained(model, dtype=None if dtype == "auto" else dtype)
            jax.block_until_ready(nnx.state(model, nnx.Param))
            self.startup_times.weight_loading_s = time.perf_counter() - t0
        elif dtype != "auto" and jnp.dtype(dtype) != model.dtype:
            raise ConfigError(f"dtype={dtype!r} differs from the loaded model's {model.dtype}; pass dtype='auto'")
        return checkpoint, with_dt_clamp(model, self.config.dt_clamp)

    def _resolve_max_model_len(self) -> int:
        max_model_len, limit = self.config.max_model_len, self.cfg.max_position_embeddings
        if max_model_len is not None and limit and max_model_len > limit:
            # As vLLM (without VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions past the trained range are refused.
            raise ConfigError(f"max_model_len={max_model_len} is above the model's max_position_embeddings={limit}")
        return max_model_len if max_model_len is not None else min(limit or 2048, 2048)

    def _make_proposer(self):
        """``(proposer, num_speculative_tokens)``; ``(None, 0)`` without speculative decoding."""
        spec = self.config.speculative_config
        if not spec:
            return None, 0
        return make_proposer(spec, target_cfg=self.cfg, max_num_seqs=self.config.max_num_seqs,
                             max_model_len=self.max_model_len, dtype=self.dtype, dt_clamp=self.config.dt_clamp)

    def _allocate_pools(self, bucket_set, num_spec: int, executable_cache):
        """Size the pools to the memory budget, allocate the caches and build the prefix-cache manager and
        the scheduler over them; returns ``(caches, what the runner is built with)``: on one device the
        caches are a ``Future`` (allocated on a thread) and the runner gets their shapes, else both are the
        caches."""
        c, t0 = self.config, time.perf_counter()
        dtype = jnp.dtype(self.dtype)
        ssm_dtype = jnp.dtype(c.mamba_ssm_cache_dtype or self.dtype)
        # 1 + num_spec slots per running request, plus null; with prefix caching also one per KV block
        # (a cached block-end state, or the block-end checkpoints of a long prefill chunk in mode all).
        sizing = dict(max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len, block_size=c.block_size,
                      num_spec=num_spec, cache_mode=c.mamba_cache_mode, dtype=dtype, ssm_dtype=ssm_dtype,
                      tp_size=c.tensor_parallel_size, num_blocks=c.num_blocks, num_slots=c.num_slots)
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu:
            budget = gpu_cache_budget(self.model, bucket_set, c.gpu_memory_utilization, c.kernel_backend, sizing,
                                      c.tensor_parallel_size, executable_cache=executable_cache)
        else:
            budget = int(c.cpu_memory_gib * GIB)
        self.pools = size_pools(budget, self.cfg, **sizing, cap_blocks=not (on_gpu and c.enable_prefix_caching))
        self.num_blocks, num_slots = self.pools.num_blocks, self.pools.num_slots
        self.mesh = None
        if c.tensor_parallel_size != 1 or self.devices is not None:
            # Caches are allocated directly in vLLM's per-rank layout, one shard per device.
            self.mesh = parallel.make_mesh(c.tensor_parallel_size, self.devices, cfg=self.cfg)
            caches = parallel.shard_caches(self.cfg, self.mesh, num_slots, self.num_blocks, c.block_size,
                                           num_spec=num_spec, dtype=dtype, ssm_dtype=ssm_dtype)
        else:
            # Zero-filling the pools (memory-bound: ~0.7 s for 2 GB on the CPU) runs beside the step programs'
            # build, which needs only their shapes; the runner gets them when both are done.
            allocate = functools.partial(
                allocate_caches, self.cfg, num_slots=num_slots, num_blocks=self.num_blocks, block_size=c.block_size,
                num_spec=num_spec, dtype=dtype, ssm_dtype=ssm_dtype)
            shapes = jax.eval_shape(allocate)
            allocator = ThreadPoolExecutor(1, thread_name_prefix="jaxmamba-pools")
            caches = allocator.submit(lambda: jax.block_until_ready(allocate(executable_cache=executable_cache)))
            allocator.shutdown(wait=False)
        self.kv = PrefixCacheManager(
            self.num_blocks, num_slots, c.block_size, c.mamba_cache_mode, num_spec,
            has_attention=bool(self.cfg.attention_layer_ids), has_mamba=bool(self.cfg.mamba_layer_ids),
            max_model_len=self.max_model_len, mamba_chunk_size=self.cfg.mamba_chunk_size,
            enable_caching=c.enable_prefix_caching, max_num_batched_tokens=c.max_num_batched_tokens,
        )
        self.scheduler = Scheduler(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                   kv=self.kv)
        if not isinstance(caches, Future):
            shapes = jax.block_until_ready(caches)
        self.startup_times.cache_setup_s += time.perf_counter() - t0
        return caches, shapes

    def _build_runner(self, caches, bucket_set, num_spec: int, executable_cache) -> ModelRunner:
        c = self.config
        progress = attached_to_terminal() if c.compile_progress is None else c.compile_progress
        return ModelRunner(self.model, caches, self.kv, buckets=bucket_set, max_model_len=self.max_model_len,
                           num_slots=self.pools.num_slots, num_blocks=self.num_blocks, backend=c.kernel_backend,
                           mesh=self.mesh, compile_progress=progress, sampling_variants=c.sampling_variants,
                           num_scheduler_steps=c.num_scheduler_steps, compile=c.compile, restore=c.restore,
                           executable_cache=executable_cache, matmul_precision=c.matmul_precision,
                           async_dispatch=c.async_dispatch)

    def _record_build_times(self) -> None:
        times, steps = self.startup_times, self.runner.steps
        build = steps.build_stats
        times.lowering_s, times.backend_compile_s = build.lowering_s, build.backend_compile_s
        times.compile_wall_s, times.cache_restore_s = build.wall_s, build.restore_s
        times.num_compiled, times.num_restoring = build.num_compiled, steps.num_deferred_restores
        times.num_restored = build.num_restored + times.num_restoring
        times.build_threads = steps.build_workers
        times.backend_compiles, times.lowerings = steps.startup_backend_compiles, steps.startup_lowerings

    # ------------------------------------------------------------------ the step loop's settings
    @property
    def host_profile(self) -> HostProfile | None:
        """Set to a ``HostProfile()`` to time the host's phases per step (``bench serve --profile-host``);
        None (the default): off."""
        return self.runner.profile

    @host_profile.setter
    def host_profile(self, profile: HostProfile | None) -> None:
        self.runner.profile = profile

    @property
    def proposer(self):
        """The speculative proposer (None without speculative decoding); tests swap in their own."""
        return self.step_loop.proposer

    @proposer.setter
    def proposer(self, proposer) -> None:
        self.step_loop.proposer = proposer

    @property
    def num_spec(self) -> int:
        return self.step_loop.num_spec

    @property
    def async_scheduling(self) -> bool:
        return self.step_loop.async_scheduling

    @property
    def num_scheduler_steps(self) -> int:
        return self.step_loop.num_scheduler_steps

    # ------------------------------------------------------------------ requests
    def prompt_token_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: a list (or 1-D integer numpy array) of ids, ``{"prompt_token_ids": [...]}``,
        ``{"prompt": "..."}`` or a string (needs a tokenizer). ``RequestError`` for anything else."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise RequestError(f"a prompt dict needs 'prompt_token_ids' or 'prompt'; got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("string prompts need a tokenizer.json in the checkpoint directory; pass token ids")
            check_utf8(prompt, "prompt")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise RequestError(f"a numpy prompt must be a 1-D integer array, got {prompt.dtype} {prompt.shape}")
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"a prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                               f"not {type(prompt).__name__}")
        if set(map(type, prompt)) <= {int}:  # plain ints (not bools): nothing to check per token or convert
            return list(prompt)
        for i, t in enumerate(prompt):
            if not is_int(t):
                raise RequestError(f"token id {t!r} at position {i} is not an int ({type(t).__name__})")
        return [int(t) for t in prompt]

    def _find(self, request_id: str) -> Request | None:
        for req in (*self.scheduler.waiting, *self.scheduler.running):
            if req.request_id == request_id:
                return req
        return self.scheduler.held.get(request_id)

    def next_request_index(self) -> int:
        """A fresh number for a generated request id (``jm-N`` here, ``gen-N`` for ``LLM.generate``)."""
        return next(self._ids)

    def new_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate ``prompt`` and make its ``Request`` without queueing it (``add_request`` queues it; a P/D
        decode engine admits it with its first tokens computed elsewhere, ``Scheduler.admit_computed``).
        Every check a step relies on happens here, so a queued request cannot fail a step."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        if params.n != 1:
            raise RequestError(f"n={params.n}: an engine request is one sample; LLMEngine/LLM.generate fan n out")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the checkpoint's tokenizer.json; use stop_token_ids")
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise RequestError(f"request_id={request_id!r} must be a non-empty string")
            if self._find(request_id) is not None or self.kv.has_request(request_id):
                raise RequestError(f"request_id={request_id!r} is already in use")
        ids = self.prompt_token_ids(prompt)
        ban = self._check_fits(ids, params)
        seed = device_seed(params.seed) if params.seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        rid = request_id if request_id is not None else f"jm-{self.next_request_index()}"
        return Request(rid, ids, params, seed=seed, arrival=next(self._arrivals), arrival_time=time.monotonic(),
                       min_tokens_ban=ban)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> tuple[int, ...]:
        """``RequestError`` unless the prompt and its params fit the model and the pools; returns the ids
        ``min_tokens`` bans until then."""
        if not ids:
            raise RequestError("prompt is empty")
        vocab = self.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise RequestError(f"stop_token_ids holds {bad_stop[0]}, outside the vocabulary [0, {vocab})")
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks - 1:
            raise RequestError(f"request needs {cdiv(longest, self.block_size)} KV blocks; the pool has "
                               f"{self.num_blocks - 1}")
        ban = tuple(dict.fromkeys([*self.cfg.eos_token_id, *params.stop_token_ids])) if params.min_tokens else ()
        if len(ban) > MAX_BANNED_IDS:
            raise RequestError(f"min_tokens={params.min_tokens} bans EOS and stop ids until then: {len(ban)} ids, "
                               f"more than the step's {MAX_BANNED_IDS}")
        return ban

    def queue(self, req: Request) -> None:
        """Queue a request made by ``new_request``."""
        req.arrival_time = time.monotonic()
        self.scheduler.add(req)
        if self.replicator is not None:
            self.replicator.queued(req)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and queue one engine request; raises ``RequestError`` naming the problem. (The request
        API with caller ids, ``n`` and ``RequestOutput``s is ``LLMEngine``.)"""
        req = self.new_request(prompt, params, request_id)
        self.queue(req)
        return req

    def abort_request(self, request_ids) -> list[Request]:
        """Abort engine requests by id (a string or an iterable of them); unknown or finished ids are ignored,
        as vLLM. Their blocks and slots return to the pools at once; returns the requests aborted."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self.replicator is not None:
            self.replicator.aborted(ids)
        self.step_loop.forget(ids)
        aborted = []
        for rid in ids:
            req = self._find(rid)
            if req is None:
                continue
            if rid in self.scheduler.held:
                self.scheduler.release_held(rid)
                continue
            self.scheduler.hold_on_finish.discard(rid)
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
            self.scheduler.finish(req, "abort")
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self.step_loop.has_pending()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Request]:
        """One engine iteration (``StepLoop.step``); returns the engine requests that finished in it (and any
        a fault or an interrupt finished since the last call)."""
        with maybe_step(self.runner.profile):
            if self.replicator is None:
                return self.step_loop.step()
            self.replicator.before_step()
            finished = self.step_loop.step()
            self.replicator.after_step()
            return finished

    @property
    def last_step(self) -> list[Request]:
        """The requests that got tokens or finished in the last ``step()``."""
        return self.step_loop.last_step

    # ------------------------------------------------------------------ outputs
    def output_text(self, req: Request, *, final: bool) -> str | None:
        return output_text(self.tokenizer, req, final=final)

    def completion(self, req: Request, index: int = 0) -> CompletionOutput:
        return completion_output(self.tokenizer, req, index)

    def request_output(self, req: Request) -> RequestOutput:
        """vLLM's ``RequestOutput`` for one engine request (finished or not)."""
        return RequestOutput(req.request_id, list(req.prompt_token_ids), [self.completion(req)], req.finished,
                             error=req.error, num_cached_tokens=req.num_cached_tokens)

    # ------------------------------------------------------------------ state
    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and pool usage (a copy: later steps do not change it)."""
        s = self._stats
        s.num_preemptions = self.scheduler.num_preemptions
        steps = self.runner.steps
        s.backend_compiles_since_warmup = steps.backend_compiles_since_warmup
        s.num_programs_ready = steps.programs_ready
        s.num_programs_restored = steps.programs_restored
        kv = self.kv
        s.slots_in_use, s.blocks_in_use = kv.num_used_state_slots, kv.num_used_kv_blocks
        s.slot_usage, s.block_usage = kv.state_slot_usage, kv.kv_block_usage
        p = kv.stats
        s.num_prefix_queries, s.num_prefix_query_tokens, s.num_prefix_hit_tokens = (
            p.num_queries, p.num_query_tokens, p.num_hit_tokens)
        s.num_cached_blocks = kv.num_cached_blocks
        return dataclasses.replace(s)

    def check_invariants(self) -> None:
        """Pool and cache invariants (``SlotError`` on any): no leak, no id both free and held, null ids never
        handed out; exactly the running requests (and those the scheduler holds after finishing, for P/D
        disaggregation) hold blocks and slots; waiting requests hold none and are not finished; and the
        caches are live (never left donated by a failed step)."""
        self.kv.check_invariants()
        holders = {r.request_id for r in self.scheduler.running} | set(self.scheduler.held)
        for rid in holders:
            if not self.kv.has_request(rid):
                raise SlotError(f"running request {rid!r} holds no blocks or slots")
        stray = set(self.kv.request_ids) - holders
        if stray:
            raise SlotError(f"requests that are not running still hold blocks or slots: {sorted(stray)}")
        for req in self.scheduler.waiting:
            if req.finished or req.num_computed_tokens:
                raise SlotError(f"waiting request {req.request_id!r} is finished or has computed tokens")
        ids = [r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)]
        if len(set(ids)) != len(ids):
            raise SlotError("a request id is queued twice")
        if self.runner.caches_lost():
            raise SlotError("the caches were donated to a step and never replaced")
        if self.runner.block_table is not None:
            self.runner.check_tables(self.scheduler.running)


def load_tokenizer(checkpoint: Path | None) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None (no checkpoint directory, or it ships none)."""
    if checkpoint is None or not (checkpoint / "tokenizer.json").exists():
        return None
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
