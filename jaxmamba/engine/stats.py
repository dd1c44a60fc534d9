"""The engine's counters: ``EngineStats`` (``LLM.stats``) and ``StartupTimes`` (``LLM.startup_times``)."""

from __future__ import annotations

from dataclasses import dataclass


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
    cache_restore_s: float = 0.0  # loading serialised executables (before the constructor returned)
    total_s: float = 0.0
    num_compiled: int = 0
    num_restored: int = 0  # from the executable cache: restored, or restoring in the background (num_restoring)
    num_restoring: int = 0  # of num_restored: handed to a background restore (restore="background")
    build_threads: int = 0  # threads the programs were built on (``program_builder.default_workers``)
    backend_compiles: int = 0  # XLA backend compilations while building the step programs
    lowerings: int = 0  # jax lowerings (jaxpr -> StableHLO) while building the step programs
    # The same over the whole construction (weights, pools, device tables, steps): 0 and 0 on a warm start.
    total_backend_compiles: int = 0
    total_lowerings: int = 0


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
