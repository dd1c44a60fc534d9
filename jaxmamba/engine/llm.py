"""``LLM``: vLLM's offline entry point, a thin wrapper over ``LLMEngine`` (which owns the ``EngineCore``)."""

from __future__ import annotations

from typing import Callable, Sequence

from jaxmamba.engine.chat import load_chat_template, render_chat
from jaxmamba.engine.core import EngineCore
from jaxmamba.engine.engine_args import EngineConfig
from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.request import RequestOutput, SamplingParams
from jaxmamba.engine.stats import EngineStats, StartupTimes
from jaxmamba.errors import RequestError

__all__ = ["LLM", "EngineStats", "StartupTimes"]


def _core_attribute(name: str, *, settable: bool = False) -> property:
    """A property reading (and with ``settable``, writing) the engine core's ``name``."""

    def get(self):
        return getattr(self.engine_core, name)

    def set_(self, value):
        setattr(self.engine_core, name, value)

    return property(get, set_ if settable else None, doc=f"The engine core's ``{name}`` (``EngineCore.{name}``).")


class LLM:
    """Offline generation: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``.

    ``model`` is a checkpoint directory (HF or orbax) or a loaded ``HybridForCausalLM``; the engine
    arguments are ``EngineConfig``'s (vLLM's names; documented there), validated before the model loads.
    ``llm_engine`` is vLLM's request API over the same engine (``add_request(request_id, prompt, params)``,
    ``step()``, ``abort_request``), and ``engine_core`` the engine itself. This class's own
    ``add_request``/``step`` are the core's, on engine ``Request``s (one sample each), for in-tree drivers
    such as P/D disaggregation; its other engine attributes (``scheduler``, ``runner``, ``kv``, ``stats``,
    ``startup_times``, ``host_profile``, ...) read the core's.
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
        restore: str = "background",
        executable_cache: bool | None = None,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        distributed_timeout_s: int = 100,
        matmul_precision: str = "auto",
        async_dispatch: str = "auto",
    ):
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching, mamba_cache_mode=mamba_cache_mode,
                              speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
                              dtype=dtype, kernel_backend=kernel_backend,
                              mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, buckets=buckets, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization, cpu_memory_gib=cpu_memory_gib,
                              num_slots=num_slots, compile_progress=compile_progress, dt_clamp=dt_clamp,
                              sampling_variants=sampling_variants, async_scheduling=async_scheduling,
                              compile_cache=compile_cache, num_scheduler_steps=num_scheduler_steps,
                              compile=compile, restore=restore, executable_cache=executable_cache,
                              coordinator_address=coordinator_address, num_processes=num_processes,
                              process_id=process_id, distributed_timeout_s=distributed_timeout_s,
                              matmul_precision=matmul_precision, async_dispatch=async_dispatch)
        self.llm_engine = LLMEngine.from_engine_config(model, config)

    @property
    def engine_core(self) -> EngineCore:
        return self.llm_engine.engine_core

    # The engine's parts and settings, read from the core (tests and benchmarks reach inside).
    config = _core_attribute("config")
    model = _core_attribute("model")
    cfg = _core_attribute("cfg")
    dtype = _core_attribute("dtype")
    checkpoint = _core_attribute("checkpoint")
    tokenizer = _core_attribute("tokenizer")
    max_model_len = _core_attribute("max_model_len")
    block_size = _core_attribute("block_size")
    num_blocks = _core_attribute("num_blocks")
    pools = _core_attribute("pools")
    mesh = _core_attribute("mesh")
    kv = _core_attribute("kv")
    scheduler = _core_attribute("scheduler")
    runner = _core_attribute("runner")
    num_spec = _core_attribute("num_spec")
    num_scheduler_steps = _core_attribute("num_scheduler_steps")
    async_scheduling = _core_attribute("async_scheduling")
    compile_cache_dir = _core_attribute("compile_cache_dir")
    startup_times = _core_attribute("startup_times")
    stats = _core_attribute("stats")
    proposer = _core_attribute("proposer", settable=True)
    host_profile = _core_attribute("host_profile", settable=True)

    @property
    def _inflight(self):
        """Async scheduling: the step dispatched and not yet read back (tests check it is drained)."""
        return self.engine_core.step_loop.inflight

    # ------------------------------------------------------------------ the core's engine-request API
    def prompt_token_ids(self, prompt) -> list[int]:
        return self.engine_core.prompt_token_ids(prompt)

    def new_request(self, prompt, params: SamplingParams, request_id: str | None = None):
        return self.engine_core.new_request(prompt, params, request_id)

    def queue(self, req) -> None:
        self.engine_core.queue(req)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None):
        return self.engine_core.add_request(prompt, params, request_id)

    def abort_request(self, request_ids):
        return self.engine_core.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self):
        return self.engine_core.step()

    def output_text(self, req, *, final: bool) -> str | None:
        return self.engine_core.output_text(req, final=final)

    def completion(self, req, index: int = 0):
        return self.engine_core.completion(req, index)

    def request_output(self, req) -> RequestOutput:
        return self.engine_core.request_output(req)

    def check_invariants(self) -> None:
        self.engine_core.check_invariants()

    # ------------------------------------------------------------------ offline generation
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
        template = chat_template if chat_template is not None else load_chat_template(self.engine_core.checkpoint)
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
        return self.llm_engine.get_tokenizer()

