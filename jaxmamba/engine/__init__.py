"""The serving engine: scheduler -> runner -> model, behind vLLM's ``LLM`` API."""

from jaxmamba.engine.core import EngineCore
from jaxmamba.engine.engine_args import EngineConfig, limits_for_prompts
from jaxmamba.engine.llm import LLM
from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.request import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams
from jaxmamba.engine.stats import EngineStats

__all__ = ["LLM", "LLMEngine", "EngineCore", "EngineConfig", "EngineStats", "CompletionOutput", "Logprob",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "limits_for_prompts"]
