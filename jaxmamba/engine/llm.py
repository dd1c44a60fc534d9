"""``LLM``: vLLM's offline entry point, over jaxmamba's scheduler -> runner -> model."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba.cache import allocate_caches
from jaxmamba.engine.chat import load_chat_template, render_chat
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.outputs import completion_output, output_text
from jaxmamba.engine.request import (CompletionOutput, Request, RequestOutput, SamplingParams, check_utf8,
                                     device_seed, is_int)
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import Scheduler, cdiv
from jaxmamba.engine.step_loop import StepLoop
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.host_profile import HostProfile
from jaxmamba.plan import GIB, gpu_cache_budget, resolve_kernel_backend, size_pools
from jaxmamba.sampling import MAX_BANNED_IDS
from jaxmamba.steps import check_sampling_variants, engine_buckets



@dataclass
class StartupTimes:
    """Where ``LLM``'s construction spent its time (seconds): the phases of ``python -m jaxmamba.bench startup``."""

    weight_loading_s: float = 0.0  # reading the checkpoint into device arrays
    # Sizing and allocating the KV/state pools (on a GPU with the sizing probe: the largest bucket built once
    # for its temporaries), the compilation cache directories.
    cache_setup_s: float = 0.0
    lowering_s: float = 0.0  # tracing and lowering the step programs (one thread)
    backend_compile_s: float = 0.0  # XLA's compiles, summed over the compile threads
    compile_wall_s: float = 0.0  # building the programs the engine waits for, wall clock
    cache_restore_s: float = 0.0  # loading serialised executables
    total_s: float = 0.0
    num_compiled: int = 0
    num_restored: int = 0
    backend_compiles: int = 0  # XLA backend compilations while building the step programs


@dataclass
class EngineStats:
    num_buckets: int = 0
    num_compilations: int = 0  # step executables built (compiled or restored from the cache) at start-up
    num_step_programs: int = 0  # planned: one per bucket and sampling variant (``sampling_variants``)
    num_programs_ready: int = 0  # built so far (``compile="lazy"``: grows while serving, up to num_step_programs)
    num_programs_restored: int = 0  # loaded from the executable cache instead of compiled
    backend_compiles_since_warmup: int = 0  # any XLA compilation in the process after warm-up
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt (and recomputed) tokens processed
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative tokens proposed and verified
    num_accepted_draft_tokens: int = 0
    slots_in_use: int = 0
    blocks_in_use: int = 0
    slot_usage: float = 0.0
    block_usage: float = 0.0
    num_prefix_queries: int = 0  # admissions looked up in the prefix cache
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # tokens served from the prefix cache instead of computed
    num_cached_blocks: int = 0  # full blocks in the prefix cache now

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens (vLLM's prefix-cache hit rate); 0 without prefix caching."""
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def _ssm_cache_dtype(value) -> str | None:
    """vLLM's ``mamba_ssm_cache_dtype``: ``auto``/None (the model's dtype), float32, bfloat16 or float16."""
    from jaxmamba.weights import canonical_dtype

    try:
        return canonical_dtype(value)
    except ConfigError:
        raise ConfigError(f"mamba_ssm_cache_dtype={value!r} must be 'auto', float32, bfloat16 or float16 "
                          "(as vLLM)") from None


def _check_engine_ints(**values) -> None:
    for name, value in values.items():
        if value is None and name in ("num_blocks", "num_slots", "max_model_len"):
            continue
        if not is_int(value):
            raise ConfigError(f"{name}={value!r} must be an int")
        if name != "seed" and value <= 0:
            raise ConfigError(f"{name}={value} must be > 0")


class LLM(StepLoop):
    """Offline generation: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``.

    ``model`` is a checkpoint directory (HF or orbax) or a loaded ``HybridForCausalLM``.
    Engine args follow vLLM's names; features that are not implemented yet raise
    ``ConfigError`` rather than being silently ignored. ``dtype``: ``"auto"`` (the checkpoint's),
    float32/bfloat16/float16 or vLLM's aliases (``"float"``, ``"half"``; also ``"bf16"``, ``"fp16"``).
    ``compile_progress``: a bar counting the step programs as they are built (None, the default: shown
    where stderr is a terminal); a start that finds every program in the cache says "loading N programs
    from the cache". ``compile``: ``"eager"`` builds every step program before the constructor returns;
    ``"lazy"`` only the pure-decode buckets and the largest mixed bucket, the rest on a background thread
    while serving (a batch meanwhile takes the smallest built bucket that holds it; nothing compiles on the
    serving path; ``stats.num_programs_ready`` counts the built ones).
    ``sampling_variants``: which buckets also compile a greedy-only sampling tail (an argmax, no sort,
    no random draws, no logprobs), used when no request of a batch samples or asks for logprobs:
    ``"auto"`` (buckets of >= 16 rows of about a token each, ``buckets.wants_greedy_tail``),
    ``"decode"`` (pure-decode buckets), ``"all"``, or ``"full"`` (none: the fewest compilations).
    ``async_scheduling``: as vLLM's, schedule and dispatch each step before the previous one is read
    back, so the host's work hides behind the device's (tokens as without it; used when there is no
    speculative decoding and no prefix caching, otherwise steps run synchronously).
    ``compile_cache``: JAX's persistent compilation cache for the step programs, so that a restart
    loads them instead of compiling again (``jaxmamba.compile_cache``): ``"auto"``
    (``$JAXMAMBA_COMPILE_CACHE``, else ``~/.cache/jaxmamba/xla``), a directory, or None; a cache
    directory already configured in JAX is kept. The step executables themselves are kept serialised
    in its ``jaxmamba-steps`` subdirectory (``compile_cache.ExecutableCache``): a restart with the same model,
    engine arguments, code, jax and device restores them without tracing or compiling.
    ``startup_times``: where the construction's time went (``StartupTimes``).
    ``num_scheduler_steps``: vLLM (V0)'s multi-step scheduling. With K > 1, a batch of plain decodes (no
    drafts, and no waiting request that could take a free row) runs up to K decode steps in one device call,
    each row stopping at its length limit; the host schedules, reads back and checks stops once per window
    (tokens as with K = 1; a row that stops on EOS or a stop id inside the window wastes the window's
    remaining steps). It trades the host's per-step work for one extra program per pure-decode bucket and
    sampling variant. Needs no prefix caching and no speculative decoding.

    ``generate`` is the offline API; ``llm_engine`` is vLLM's request API over the same engine
    (``add_request(request_id, prompt, params)``, ``step()``, ``abort_request``). This class's own
    ``add_request``/``step`` work on engine ``Request``s (one sample each), for in-tree drivers
    such as P/D disaggregation.
    """

    def __init__(
        self,
        model,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = False,
        mamba_cache_mode: str | None = None,
        speculative_config: dict | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        kernel_backend: str = "auto",
        mamba_ssm_cache_dtype: str | None = None,
        buckets: Sequence[tuple[int, int]] | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        cpu_memory_gib: float = 4.0,
        num_slots: int | None = None,
        compile_progress: bool | None = None,
        dt_clamp: str = "checkpoint",
        sampling_variants: str = "auto",
        async_scheduling: bool = True,
        compile_cache: str | None = "auto",
        num_scheduler_steps: int = 1,
        compile: str = "eager",
    ):
        """Pools: ``num_blocks`` KV blocks and ``num_slots`` Mamba state slots (each counting the null
        block/slot 0) fill the memory budget (``jaxmamba.plan.size_pools``): on a GPU
        ``gpu_memory_utilization`` x device memory after weights and the largest bucket's temporaries,
        on the CPU ``cpu_memory_gib`` of cache space; given explicitly they win.
        ``dtype="auto"``: the checkpoint's ``torch_dtype``; ``kernel_backend="auto"``: Pallas on a GPU,
        the plain-JAX reference on the CPU. ``dt_clamp="vllm"``: clamp dt as vLLM's ``MambaMixer2``
        (``(0, inf)``) instead of as the checkpoint says (transformers' reading; they differ for NemotronH's
        ``time_step_min``), for exact comparisons against vLLM."""
        from jaxmamba.compile_cache import enable_compile_cache, executable_cache_for
        from jaxmamba.compile_progress import attached_to_terminal
        from jaxmamba.steps import COMPILE_MODES
        from jaxmamba.weights import canonical_dtype, check_dt_clamp, load_pretrained, with_dt_clamp

        # Before the weights load and the caches are allocated: a typo must not cost a model load.
        check_dt_clamp(dt_clamp)
        check_sampling_variants(sampling_variants)
        if compile not in COMPILE_MODES:
            raise ConfigError(f"compile={compile!r} must be one of {COMPILE_MODES}")
        started = time.perf_counter()
        times = self.startup_times = StartupTimes()
        dtype = canonical_dtype(dtype) or "auto"  # vLLM's aliases ("half", "float", also "bf16") -> names
        mamba_ssm_cache_dtype = _ssm_cache_dtype(mamba_ssm_cache_dtype)
        _check_engine_ints(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           block_size=block_size, num_blocks=num_blocks, num_slots=num_slots,
                           max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size, seed=seed,
                           num_scheduler_steps=num_scheduler_steps)
        if num_scheduler_steps > 1 and (enable_prefix_caching or mamba_cache_mode not in (None, "none")
                                        or speculative_config):
            raise ConfigError(f"num_scheduler_steps={num_scheduler_steps} needs mamba_cache_mode='none' (no prefix "
                              "caching) and no speculative decoding: their Mamba slots move inside a window")

        # As vLLM, the Mamba cache mode follows enable_prefix_caching ("align" unless "all" is asked for).
        if mamba_cache_mode is None:
            mamba_cache_mode = "align" if enable_prefix_caching else "none"
        if mamba_cache_mode not in ("none", "align", "all"):
            raise ConfigError(f"mamba_cache_mode={mamba_cache_mode!r} must be 'none', 'align' or 'all'")
        if enable_prefix_caching != (mamba_cache_mode != "none"):
            raise ConfigError(f"mamba_cache_mode={mamba_cache_mode!r} does not fit enable_prefix_caching="
                              f"{enable_prefix_caching}: modes 'align'/'all' are the Mamba side of prefix caching")
        kernel_backend = resolve_kernel_backend(kernel_backend)
        t0 = time.perf_counter()
        self.compile_cache_dir = enable_compile_cache(compile_cache)
        executable_cache = executable_cache_for(self.compile_cache_dir)
        times.cache_setup_s += time.perf_counter() - t0
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
        if not cpu_memory_gib > 0:
            raise ConfigError(f"cpu_memory_gib={cpu_memory_gib} must be > 0")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if value <= 0:
                raise ConfigError(f"{name}={value} must be > 0")

        self.checkpoint = None
        if isinstance(model, (str, Path)):
            self.checkpoint = Path(model)
            t0 = time.perf_counter()
            model = load_pretrained(model, dtype=None if dtype == "auto" else dtype)
            jax.block_until_ready(nnx.state(model, nnx.Param))
            times.weight_loading_s = time.perf_counter() - t0
        elif dtype != "auto" and jnp.dtype(dtype) != model.dtype:
            raise ConfigError(f"dtype={dtype!r} differs from the loaded model's {model.dtype}; pass dtype='auto'")
        dtype = model.dtype
        model = with_dt_clamp(model, dt_clamp)
        self.model = model
        self.cfg = model.cfg
        limit = self.cfg.max_position_embeddings
        if max_model_len is not None and limit and max_model_len > limit:
            # As vLLM (without VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions past the trained range are refused.
            raise ConfigError(f"max_model_len={max_model_len} is above the model's max_position_embeddings={limit}")
        self.max_model_len = max_model_len if max_model_len is not None else min(limit or 2048, 2048)
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs}")
        self.block_size = block_size
        self.proposer, self.num_spec = (None, 0)
        if speculative_config:
            from jaxmamba.engine.spec_decode import make_proposer

            self.proposer, self.num_spec = make_proposer(speculative_config, target_cfg=self.cfg,
                                                         max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                                         dtype=dtype, dt_clamp=dt_clamp)
        bucket_set = engine_buckets(max_num_seqs, max_num_batched_tokens, self.num_spec, buckets)
        if num_scheduler_steps > 1 and not any(b.decode_only for b in bucket_set):
            raise ConfigError(f"num_scheduler_steps={num_scheduler_steps} runs its windows in pure-decode buckets; "
                              "the buckets given are all mixed (leave buckets unset)")
        ssm_dtype = jnp.dtype(mamba_ssm_cache_dtype or dtype)
        # 1 + num_spec slots per running request, plus null; with prefix caching also one per KV block
        # (a cached block-end state, or the block-end checkpoints of a long prefill chunk in mode all).
        sizing = dict(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, block_size=block_size,
                      num_spec=self.num_spec, cache_mode=mamba_cache_mode, dtype=jnp.dtype(dtype),
                      ssm_dtype=ssm_dtype, tp_size=tensor_parallel_size, num_blocks=num_blocks, num_slots=num_slots)
        on_gpu = jax.default_backend() == "gpu"
        t0 = time.perf_counter()
        if on_gpu:
            budget = gpu_cache_budget(model, bucket_set, gpu_memory_utilization, kernel_backend, sizing,
                                      tensor_parallel_size, executable_cache=executable_cache)
        else:
            budget = int(cpu_memory_gib * GIB)
        self.pools = size_pools(budget, self.cfg, **sizing, cap_blocks=not (on_gpu and enable_prefix_caching))
        self.num_blocks, num_slots = self.pools.num_blocks, self.pools.num_slots
        self.mesh = None
        if tensor_parallel_size != 1:
            from jaxmamba import parallel

            # Caches are allocated directly in vLLM's per-rank layout, one shard per device.
            self.mesh = parallel.make_mesh(tensor_parallel_size, cfg=self.cfg)
            caches = parallel.shard_caches(self.cfg, self.mesh, num_slots, self.num_blocks, block_size,
                                           num_spec=self.num_spec, dtype=jnp.dtype(dtype), ssm_dtype=ssm_dtype)
        else:
            caches = allocate_caches(
                self.cfg, num_slots=num_slots, num_blocks=self.num_blocks, block_size=block_size,
                num_spec=self.num_spec, dtype=jnp.dtype(dtype), ssm_dtype=ssm_dtype,
            )
        self.kv = PrefixCacheManager(
            self.num_blocks, num_slots, block_size, mamba_cache_mode, self.num_spec,
            has_attention=bool(self.cfg.attention_layer_ids), has_mamba=bool(self.cfg.mamba_layer_ids),
            max_model_len=self.max_model_len, mamba_chunk_size=self.cfg.mamba_chunk_size,
            enable_caching=enable_prefix_caching, max_num_batched_tokens=max_num_batched_tokens,
        )
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, kv=self.kv)
        jax.block_until_ready(caches)
        times.cache_setup_s += time.perf_counter() - t0
        if compile_progress is None:
            compile_progress = attached_to_terminal()
        self.runner = ModelRunner(model, caches, self.kv, buckets=bucket_set, max_model_len=self.max_model_len,
                                  num_slots=num_slots, num_blocks=self.num_blocks, backend=kernel_backend,
                                  mesh=self.mesh, compile_progress=compile_progress,
                                  sampling_variants=sampling_variants, num_scheduler_steps=num_scheduler_steps,
                                  compile=compile, executable_cache=executable_cache)
        self.num_scheduler_steps = num_scheduler_steps
        steps = self.runner.steps
        build = steps.build_stats
        times.lowering_s, times.backend_compile_s = build.lowering_s, build.backend_compile_s
        times.compile_wall_s, times.cache_restore_s = build.wall_s, build.restore_s
        times.num_compiled, times.num_restored = build.num_compiled, build.num_restored
        times.backend_compiles = steps.startup_backend_compiles
        self._stats = EngineStats(num_buckets=len(bucket_set), num_compilations=steps.num_compilations,
                                  num_step_programs=steps.num_programs_planned)
        self._seeds = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.tokenizer = self._load_tokenizer()
        self.dtype = dtype
        self._unreported: list[Request] = []  # finished outside a step's return (a fault, an interrupt)
        self._last_step: list[Request] = []  # requests that got tokens or finished in the last step
        self.async_scheduling = async_scheduling
        self._inflight = None  # async scheduling: the dispatched step not yet read back (runner.InFlightStep)
        self._llm_engine = None
        times.total_s = time.perf_counter() - started

    @property
    def host_profile(self) -> HostProfile | None:
        """Set to a ``HostProfile()`` to time the host's phases per step (``bench serve --profile-host``);
        None (the default): off."""
        return self.runner.profile

    @host_profile.setter
    def host_profile(self, profile: HostProfile | None) -> None:
        self.runner.profile = profile

    # ------------------------------------------------------------------ requests
    def _load_tokenizer(self):
        if self.checkpoint is None or not (self.checkpoint / "tokenizer.json").exists():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.checkpoint / "tokenizer.json"))

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
        for i, t in enumerate(prompt):
            if not is_int(t):
                raise RequestError(f"token id {t!r} at position {i} is not an int ({type(t).__name__})")
        return [int(t) for t in prompt]

    def _find(self, request_id: str) -> Request | None:
        for req in (*self.scheduler.waiting, *self.scheduler.running):
            if req.request_id == request_id:
                return req
        return self.scheduler.held.get(request_id)

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
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) > self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad_stop = [t for t in params.stop_token_ids if t >= self.cfg.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids holds {bad_stop[0]}, outside the vocabulary [0, {self.cfg.vocab_size})")
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks - 1:
            raise RequestError(f"request needs {cdiv(longest, self.block_size)} KV blocks; the pool has "
                               f"{self.num_blocks - 1}")
        ban = tuple(dict.fromkeys([*self.cfg.eos_token_id, *params.stop_token_ids])) if params.min_tokens else ()
        if len(ban) > MAX_BANNED_IDS:
            raise RequestError(f"min_tokens={params.min_tokens} bans EOS and stop ids until then: {len(ban)} ids, "
                               f"more than the step's {MAX_BANNED_IDS}")
        seed = device_seed(params.seed) if params.seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        rid = request_id if request_id is not None else f"jm-{next(self._ids)}"
        return Request(rid, ids, params, seed=seed, arrival=next(self._arrivals), arrival_time=time.monotonic(),
                       min_tokens_ban=ban)

    def queue(self, req: Request) -> None:
        """Queue a request made by ``new_request``."""
        req.arrival_time = time.monotonic()
        self.scheduler.add(req)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and queue one engine request; raises ``RequestError`` naming the problem. (The request
        API with caller ids, ``n`` and ``RequestOutput``s is ``LLMEngine``, ``llm.llm_engine``.)"""
        req = self.new_request(prompt, params, request_id)
        self.queue(req)
        return req

    def abort_request(self, request_ids) -> list[Request]:
        """Abort engine requests by id (a string or an iterable of them); unknown or finished ids are ignored,
        as vLLM. Their blocks and slots return to the pools at once; returns the requests aborted."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        gone = set(ids)
        self._unreported = [r for r in self._unreported if r.request_id not in gone]
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
        return self.scheduler.has_work or bool(self._unreported) or self._inflight is not None

    def _fail(self, req: Request, error: str) -> None:
        """Finish ``req`` with ``finish_reason="error"`` (its blocks and slots go back to the pools)."""
        req.error = error
        self.scheduler.hold_on_finish.discard(req.request_id)  # its state is not to be handed on
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self.scheduler.finish(req, "error")

    def output_text(self, req: Request, *, final: bool) -> str | None:
        return output_text(self.tokenizer, req, final=final)

    def completion(self, req: Request, index: int = 0) -> CompletionOutput:
        return completion_output(self.tokenizer, req, index)

    def request_output(self, req: Request) -> RequestOutput:
        """vLLM's ``RequestOutput`` for one engine request (finished or not)."""
        return RequestOutput(req.request_id, list(req.prompt_token_ids), [self.completion(req)], req.finished,
                             error=req.error, num_cached_tokens=req.num_cached_tokens)

    # ------------------------------------------------------------------ the request API
    @property
    def llm_engine(self):
        """vLLM's request API over this engine (``add_request(request_id, ...)``, ``step() -> RequestOutput``s)."""
        if self._llm_engine is None:
            from jaxmamba.engine.llm_engine import LLMEngine

            self._llm_engine = LLMEngine(self)
        return self._llm_engine

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order, each with its ``n`` completions.

        Atomic: every prompt is validated before any is queued. A prompt that cannot be served (too long,
        a token id outside the vocabulary, text that is not valid UTF-8) gets an output with ``error`` set
        and ``text == ""``, and the others run; a bad argument (a params list of the wrong length, params
        that are not ``SamplingParams``) raises with nothing queued; an exception or Ctrl-C while
        generating aborts this call's requests before it propagates, so no later call computes them.
        ``use_tqdm`` (vLLM's): True shows a bar of finished prompts where stderr is a terminal; a callable
        is the bar's class (``tqdm.auto.tqdm`` in a notebook); False shows none.
        """
        return self.llm_engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of ``{"role", "content"}`` dicts;
        ``content`` a string or a list of text parts) or a list of them. Each is rendered with
        ``chat_template`` or else the checkpoint's (``tokenizer_config.json``), then generated as
        ``generate`` does. A malformed message raises ``RequestError`` with nothing queued."""
        template = chat_template if chat_template is not None else load_chat_template(self.checkpoint)
        if template is None:
            raise RequestError("this checkpoint has no chat template (tokenizer_config.json 'chat_template'); "
                               "pass chat_template=... or use generate")
        conversations = messages if isinstance(messages, list) and messages and isinstance(messages[0], list) \
            else [messages]
        prompts = [render_chat(template, c, add_generation_prompt=add_generation_prompt,
                               **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self):
        """The checkpoint's tokenizer (a ``tokenizers.Tokenizer``, from ``tokenizer.json``), or None if it
        ships none (then prompts and outputs are token ids only)."""
        return self.tokenizer

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters and pool usage (a copy: later steps do not change it)."""
        s = self._stats
        s.num_preemptions = self.scheduler.num_preemptions
        steps = self.runner.steps
        s.backend_compiles_since_warmup = steps.backend_compiles_since_warmup
        s.num_programs_ready = steps.programs_ready
        s.num_programs_restored = steps.build_stats.num_restored
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
