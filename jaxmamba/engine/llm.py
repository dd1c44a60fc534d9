"""``LLM``: vLLM's offline entry point, over jaxmamba's scheduler -> runner -> model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba.cache import allocate_caches
from jaxmamba.engine.prefix_cache import PrefixCacheManager
from jaxmamba.engine.request import CompletionOutput, Request, RequestOutput, SamplingParams, Status
from jaxmamba.engine.runner import ModelRunner
from jaxmamba.engine.scheduler import Scheduler, cdiv
from jaxmamba.errors import ConfigError, RequestError, SlotError
from jaxmamba.plan import GIB, resolve_kernel_backend, size_pools
from jaxmamba.steps import engine_buckets


@dataclass
class EngineStats:
    num_buckets: int = 0
    num_compilations: int = 0  # step executables compiled (all at start-up)
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


class LLM:
    """Offline generation: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``.

    ``model`` is a checkpoint directory (HF or orbax) or a loaded ``HybridForCausalLM``.
    Engine args follow vLLM's names; features that are not implemented yet raise
    ``ConfigError`` rather than being silently ignored.
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
    ):
        """Pools: ``num_blocks`` KV blocks and ``num_slots`` Mamba state slots (each counting the null
        block/slot 0) fill the memory budget (``jaxmamba.plan.size_pools``): on a GPU
        ``gpu_memory_utilization`` x device memory after weights and the largest bucket's temporaries,
        on the CPU ``cpu_memory_gib`` of cache space; given explicitly they win.
        ``dtype="auto"``: the checkpoint's ``torch_dtype``; ``kernel_backend="auto"``: Pallas on a GPU,
        the plain-JAX reference on the CPU."""
        from jaxmamba.weights import load_pretrained

        # As vLLM, the Mamba cache mode follows enable_prefix_caching ("align" unless "all" is asked for).
        if mamba_cache_mode is None:
            mamba_cache_mode = "align" if enable_prefix_caching else "none"
        if mamba_cache_mode not in ("none", "align", "all"):
            raise ConfigError(f"mamba_cache_mode={mamba_cache_mode!r} must be 'none', 'align' or 'all'")
        if enable_prefix_caching != (mamba_cache_mode != "none"):
            raise ConfigError(f"mamba_cache_mode={mamba_cache_mode!r} does not fit enable_prefix_caching="
                              f"{enable_prefix_caching}: modes 'align'/'all' are the Mamba side of prefix caching")
        if mamba_cache_mode == "align" and max_num_batched_tokens < block_size:
            raise ConfigError(f"mamba_cache_mode='align' cuts prefill chunks at block ends: max_num_batched_tokens="
                              f"{max_num_batched_tokens} must be >= block_size={block_size}")
        kernel_backend = resolve_kernel_backend(kernel_backend)
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
            model = load_pretrained(model, dtype=None if dtype == "auto" else dtype)
        elif dtype != "auto" and jnp.dtype(dtype) != model.dtype:
            raise ConfigError(f"dtype={dtype!r} differs from the loaded model's {model.dtype}; pass dtype='auto'")
        dtype = model.dtype
        self.model = model
        self.cfg = model.cfg
        self.max_model_len = max_model_len or min(self.cfg.max_position_embeddings or 2048, 2048)
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs}")
        self.block_size = block_size
        self.proposer, self.num_spec = (None, 0)
        if speculative_config:
            from jaxmamba.engine.spec_decode import make_proposer

            self.proposer, self.num_spec = make_proposer(speculative_config, target_cfg=self.cfg,
                                                         max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                                         dtype=dtype)
        bucket_set = engine_buckets(max_num_seqs, max_num_batched_tokens, self.num_spec, buckets)
        ssm_dtype = jnp.dtype(mamba_ssm_cache_dtype or dtype)
        # 1 + num_spec slots per running request, plus null; with prefix caching also one per KV block
        # (a cached block-end state, or the block-end checkpoints of a long prefill chunk in mode all).
        sizing = dict(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, block_size=block_size,
                      num_spec=self.num_spec, cache_mode=mamba_cache_mode, dtype=jnp.dtype(dtype),
                      ssm_dtype=ssm_dtype, tp_size=tensor_parallel_size, num_blocks=num_blocks, num_slots=num_slots)
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu:
            budget = self._gpu_cache_budget(gpu_memory_utilization, bucket_set, kernel_backend, sizing,
                                            tensor_parallel_size)
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
            enable_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, kv=self.kv)
        self.runner = ModelRunner(model, caches, self.kv, buckets=bucket_set, max_model_len=self.max_model_len,
                                  num_slots=num_slots, num_blocks=self.num_blocks, backend=kernel_backend,
                                  mesh=self.mesh)
        self._stats = EngineStats(num_buckets=len(bucket_set), num_compilations=self.runner.steps.num_compilations)
        self._seeds = np.random.default_rng(seed)
        self._ids = itertools.count()
        self.tokenizer = self._load_tokenizer()

    def _gpu_cache_budget(self, utilization: float, bucket_set, backend: str, sizing: dict, tp_size: int) -> int:
        """vLLM's start-up profile, from XLA's buffer assignment instead of a dummy run: compile the largest
        bucket at small abstract pools (its temporaries do not depend on the pool sizes), then
        ``utilization`` x device memory - weights - those temporaries. With tensor parallelism the
        single-device temporaries are used: an upper bound of one rank's."""
        from jaxmamba import aot
        from jaxmamba.plan import compile_buckets, largest_bucket, param_bytes, probe_pools

        device = jax.devices()[0]
        limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
        known = [aot.get_target(n) for n in aot.target_names()]
        total = next((t.memory_bytes for t in known if t.description in device.device_kind), limit)
        largest = largest_bucket(bucket_set)
        probe = compile_buckets(self.model, probe_pools(self.cfg, **sizing), (largest,),
                                block_size=sizing["block_size"], max_model_len=self.max_model_len, cache_mode=sizing["cache_mode"],
                                num_spec=self.num_spec, enable_caching=False, ssm_dtype=sizing["ssm_dtype"],
                                backend=backend)
        weights = param_bytes(nnx.state(self.model, nnx.Param)) // tp_size
        usable = min(int(utilization * total), limit) if limit else int(utilization * total)
        return usable - weights - probe.memory[largest].temp_bytes

    # ------------------------------------------------------------------ requests
    def _load_tokenizer(self):
        if self.checkpoint is None or not (self.checkpoint / "tokenizer.json").exists():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.checkpoint / "tokenizer.json"))

    def prompt_token_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: a list of ids, ``{"prompt_token_ids": [...]}``, or a string (needs a tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("string prompts need a tokenizer.json in the checkpoint directory; pass token ids")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams) -> Request:
        """Validate and queue one request; raises ``RequestError`` naming the problem."""
        req = self.new_request(prompt, params)
        self.scheduler.add(req)
        return req

    def new_request(self, prompt, params: SamplingParams) -> Request:
        """Validate ``prompt`` and make its ``Request`` without queueing it (``add_request`` queues it; a P/D
        decode engine admits it with its first tokens computed elsewhere, ``Scheduler.admit_computed``)."""
        ids = self.prompt_token_ids(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) > self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks - 1:
            raise RequestError(f"request needs {cdiv(longest, self.block_size)} KV blocks; the pool has "
                               f"{self.num_blocks - 1}")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        return Request(str(next(self._ids)), ids, params, seed=seed, arrival=next(self._ids))

    # ------------------------------------------------------------------ loop
    def _propose_drafts(self) -> None:
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        room = [min(r.params.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens) - 1
                for r in decoding]
        if hasattr(self.proposer, "propose_batch"):
            drafts = self.proposer.propose_batch([r.all_token_ids for r in decoding], room)
        else:
            drafts = [self.proposer.propose(r.all_token_ids, min(n, self.num_spec)) for r, n in zip(decoding, room)]
        for req, d in zip(decoding, drafts):
            req.draft_token_ids = d

    def step(self) -> list[Request]:
        """One engine iteration; returns the requests that finished in it."""
        if self.proposer is not None:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if not sched.rows:
            if self.scheduler.has_work:
                raise RequestError("no request can be scheduled: the KV block pool is too small for the waiting one")
            return []
        result = self.runner.execute(sched)
        finished = []
        for batch_row, sched_row in enumerate(result.row_order):
            row = sched.rows[sched_row]
            req = row.request
            samples, drafts = row.samples, row.num_drafts
            if req.is_prefilling or row.num_tokens > 1 + drafts:
                self._stats.num_prompt_tokens += row.num_tokens - drafts
            multi_token_decode = batch_row < result.num_decodes and row.num_tokens > 1
            if not samples:
                req.num_computed_tokens += row.num_tokens
                self.kv.commit(req.request_id, req.num_computed_tokens, req.all_token_ids,
                               num_scheduled_tokens=row.num_tokens, multi_token_decode=multi_token_decode)
                continue
            accepted = int(result.num_accepted[batch_row])
            # Rejected drafts leave no trace: their KV slots are overwritten later and the next step
            # reads the Mamba state of the last accepted token (the manager's num_accepted_tokens).
            req.num_computed_tokens += row.num_tokens - (drafts - accepted)
            req.draft_token_ids = []
            self._stats.num_draft_tokens += drafts
            self._stats.num_accepted_draft_tokens += accepted
            reason = None
            for j in range(accepted + 1):
                token = int(result.tokens[batch_row, j])
                req.output_token_ids.append(token)
                self._stats.num_generated_tokens += 1
                if req.params.logprobs is not None:
                    k = req.params.logprobs
                    ids, lps = result.top_ids[batch_row, j][:k], result.top_logprobs[batch_row, j][:k]
                    entry = {int(i): float(p) for i, p in zip(ids, lps)}
                    entry[token] = float(result.token_logprobs[batch_row, j])
                    req.output_logprobs.append(entry)
                reason = self._stop_reason(req, token)
                if reason:
                    break
            # Before finishing (which frees): full blocks computed in this step enter the prefix cache.
            # A stop inside the accepted drafts leaves tokens that are not outputs; cache only known ones.
            self.kv.commit(req.request_id, min(req.num_computed_tokens, req.num_tokens - 1), req.all_token_ids,
                           num_scheduled_tokens=row.num_tokens, multi_token_decode=multi_token_decode)
            if reason:
                self.scheduler.finish(req, reason)
                finished.append(req)
        self._stats.num_steps += 1
        return finished

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and token in self.cfg.eos_token_id) or token in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt that cannot be served gets an output with ``error`` set; the others run normally.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        slots: list[Request | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                slots.append(self.add_request(prompt, p))
            except RequestError as e:
                ids = prompt if isinstance(prompt, (list, tuple)) else []
                slots.append(RequestOutput("rejected", list(ids), [CompletionOutput(0, [], None, None, "error")],
                                           True, error=str(e)))
        pending = sum(isinstance(s, Request) for s in slots)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=pending, desc="generate", unit="req")
        while self.scheduler.has_work:
            done = self.step()
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [s if isinstance(s, RequestOutput) else self.request_output(s) for s in slots]

    def request_output(self, req: Request) -> RequestOutput:
        """vLLM's ``RequestOutput`` for a request (finished or not)."""
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else None
        completion = CompletionOutput(0, list(req.output_token_ids), text,
                                      req.output_logprobs if req.params.logprobs is not None else None,
                                      req.finish_reason)
        return RequestOutput(req.request_id, list(req.prompt_token_ids), [completion], req.status is Status.FINISHED)

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.num_preemptions = self.scheduler.num_preemptions
        s.backend_compiles_since_warmup = self.runner.steps.backend_compiles_since_warmup
        kv = self.kv
        s.slots_in_use, s.blocks_in_use = kv.num_used_state_slots, kv.num_used_kv_blocks
        s.slot_usage, s.block_usage = kv.state_slot_usage, kv.kv_block_usage
        p = kv.stats
        s.num_prefix_queries, s.num_prefix_query_tokens, s.num_prefix_hit_tokens = (
            p.num_queries, p.num_query_tokens, p.num_hit_tokens)
        s.num_cached_blocks = kv.num_cached_blocks
        return s

    def check_invariants(self) -> None:
        """Pool and cache invariants (``SlotError`` on any): no leak, no id both free and held, null ids never
        handed out; and exactly the running requests (and those the scheduler holds after finishing, for P/D
        disaggregation) hold blocks and slots."""
        self.kv.check_invariants()
        holders = {r.request_id for r in self.scheduler.running} | set(self.scheduler.held)
        for rid in holders:
            if not self.kv.has_request(rid):
                raise SlotError(f"running request {rid!r} holds no blocks or slots")
        stray = set(self.kv.request_ids) - holders
        if stray:
            raise SlotError(f"requests that are not running still hold blocks or slots: {sorted(stray)}")
