"""``EngineConfig``: the engine's arguments (``LLM(model, **engine_args)``), validated before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxmamba.buckets import check_sampling_variants, ladder
from jaxmamba.engine.request import is_int
from jaxmamba.errors import ConfigError
from jaxmamba.parallel import distributed
from jaxmamba.engine.sizing import resolve_kernel_backend
from jaxmamba.metadata import CACHE_MODES, CacheMode
from jaxmamba.steps import COMPILE_MODES, MATMUL_PRECISIONS, RESTORE_MODES, resolve_async_dispatch
from jaxmamba.weights import canonical_dtype, check_dt_clamp

MAMBA_CACHE_MODES = CACHE_MODES  # the values of CacheMode


@dataclass(frozen=True)
class EngineConfig:
    """Every engine argument ``LLM(model, **engine_args)`` takes, validated and normalised on construction
    (``ConfigError`` naming the bad one) so that a typo never costs a model load. Names follow vLLM's engine
    arguments; features that are not implemented yet raise ``ConfigError`` rather than being silently ignored.

    Resolved here: ``dtype`` (kept as its canonical name), ``mamba_cache_mode`` (None follows
    ``enable_prefix_caching``), ``kernel_backend="auto"``. ``num_blocks``/``num_slots`` (each counting the
    null block/slot 0) are sized to the memory budget unless given (``jaxmamba.engine.sizing.size_pools``).
    Constructing a config with ``coordinator_address``/``num_processes``/``process_id`` joins JAX's
    multi-controller runtime. Each argument's meaning, defaults and constraints (``compile``,
    ``sampling_variants``, ``async_scheduling``, ``async_dispatch``, ``compile_cache``, ``executable_cache``,
    ``num_scheduler_steps``, ``dt_clamp``, ``distributed_timeout_s``, ...): docs/architecture.md,
    "Engine arguments".
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 2048
    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = False
    mamba_cache_mode: CacheMode | str | None = None  # a CacheMode once validated
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    kernel_backend: str = "auto"
    mamba_ssm_cache_dtype: str | None = None
    buckets: Sequence[tuple[int, int]] | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    cpu_memory_gib: float = 4.0
    num_slots: int | None = None
    compile_progress: bool | None = None
    dt_clamp: str = "checkpoint"
    sampling_variants: str = "auto"
    async_scheduling: bool = True
    compile_cache: str | None = "auto"
    num_scheduler_steps: int = 1
    compile: str = "eager"
    restore: str = "background"  # jaxmamba.steps.RESTORE_MODES: when cached programs are deserialised
    executable_cache: bool | None = None
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed_timeout_s: int = 100
    matmul_precision: str = "auto"  # jaxmamba.steps.MATMUL_PRECISIONS: "tf32" asks for TF32 float32 matmuls on a GPU
    async_dispatch: str = "auto"  # steps.ASYNC_DISPATCH_MODES: resolved to "thread" or "inline" (resolve_async_dispatch)

    def __post_init__(self):
        check_dt_clamp(self.dt_clamp)
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ConfigError(f"matmul_precision={self.matmul_precision!r} must be one of {MATMUL_PRECISIONS}")
        check_sampling_variants(self.sampling_variants)
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile={self.compile!r} must be one of {COMPILE_MODES}")
        if self.restore not in RESTORE_MODES:
            raise ConfigError(f"restore={self.restore!r} must be one of {RESTORE_MODES}")
        if self.executable_cache not in (None, True, False):
            raise ConfigError(f"executable_cache={self.executable_cache!r} must be True, False or None")
        # vLLM's aliases ("half", "float", also "bf16") -> names
        self._normalise("dtype", canonical_dtype(self.dtype) or "auto")
        self._normalise("mamba_ssm_cache_dtype", _ssm_cache_dtype(self.mamba_ssm_cache_dtype))
        _check_engine_ints(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                           block_size=self.block_size, num_blocks=self.num_blocks, num_slots=self.num_slots,
                           max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
                           seed=self.seed, num_scheduler_steps=self.num_scheduler_steps)
        self._check_cache_mode()
        _check_engine_ints(distributed_timeout_s=self.distributed_timeout_s)
        # Before anything starts JAX's backends (kernel_backend="auto" asks which platform this is).
        if distributed.initialize(self.coordinator_address, self.num_processes, self.process_id,
                                  heartbeat_timeout_s=self.distributed_timeout_s):
            self._check_multi_process()
        self._normalise("kernel_backend", resolve_kernel_backend(self.kernel_backend))
        self._normalise("async_dispatch", resolve_async_dispatch(self.async_dispatch))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if not self.cpu_memory_gib > 0:
            raise ConfigError(f"cpu_memory_gib={self.cpu_memory_gib} must be > 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                              f"max_num_seqs={self.max_num_seqs}")

    def _check_multi_process(self) -> None:
        """Every process must issue the same programs in the same order: nothing may depend on timing."""
        if self.compile != "eager":
            raise ConfigError(f"compile={self.compile!r}: a multi-process engine needs compile='eager' (with 'lazy' "
                              "the bucket a batch takes depends on a background compile's progress, which differs "
                              "between processes)")
        if self.executable_cache:
            raise ConfigError("executable_cache=True: a multi-process engine does not restore serialised step "
                              "executables (JAX's persistent compilation cache, compile_cache, still applies)")
        self._normalise("executable_cache", False)

    def _normalise(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: only __post_init__ writes, once

    def _check_cache_mode(self) -> None:
        steps, mode = self.num_scheduler_steps, self.mamba_cache_mode
        if steps > 1 and (self.enable_prefix_caching or mode not in (None, CacheMode.NONE) or self.speculative_config):
            raise ConfigError(f"num_scheduler_steps={steps} needs mamba_cache_mode='none' (no prefix "
                              "caching) and no speculative decoding: their Mamba slots move inside a window")
        # As vLLM, the Mamba cache mode follows enable_prefix_caching ("align" unless "all" is asked for).
        if mode is None:
            mode = CacheMode.ALIGN if self.enable_prefix_caching else CacheMode.NONE
        if mode not in MAMBA_CACHE_MODES:
            raise ConfigError(f"mamba_cache_mode={mode!r} must be 'none', 'align' or 'all'")
        if self.enable_prefix_caching != (mode != CacheMode.NONE):
            raise ConfigError(f"mamba_cache_mode={mode!r} does not fit enable_prefix_caching="
                              f"{self.enable_prefix_caching}: modes 'align'/'all' are the Mamba side of prefix caching")
        self._normalise("mamba_cache_mode", CacheMode(mode))


def _ssm_cache_dtype(value) -> str | None:
    """vLLM's ``mamba_ssm_cache_dtype``: ``auto``/None (the model's dtype), float32, bfloat16 or float16."""
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


def limits_for_prompts(prompt_lengths: Sequence[int]) -> dict[str, int]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` for an engine that runs only these prompts (a one-shot job,
    ``python -m jaxmamba generate``): a row for every prompt and a first step that holds all of their tokens, each
    at most ``EngineConfig``'s default. The engine compiles a program per bucket, and the default limits' ladder
    holds buckets such a job never fills: for the CLI's three short prompts 9 programs (~9 s each on a 2-core
    CPU) where these limits compile 4. ``prompt_lengths``: the prompts' tokens (an overestimate only costs a
    larger bucket, an underestimate a prompt chunked over more steps). ``ConfigError`` for no prompts or a
    length below 1."""
    lengths = list(prompt_lengths)
    if not lengths or not all(is_int(n) and n >= 1 for n in lengths):
        raise ConfigError(f"prompt_lengths={lengths!r} must be one or more ints >= 1")
    defaults = EngineConfig.__dataclass_fields__
    top_rows, top_tokens = defaults["max_num_seqs"].default, defaults["max_num_batched_tokens"].default
    rows = min(top_rows, len(lengths))
    needed = max(rows, sum(lengths))
    tokens = next((t for t in ladder(16, top_tokens) if t >= needed), top_tokens)
    return {"max_num_seqs": rows, "max_num_batched_tokens": tokens}
