"""The serving engine: scheduler -> runner -> model, behind vLLM's ``LLM`` API."""

from jaxmamba.engine.llm import LLM, EngineStats
from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.request import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineStats", "CompletionOutput", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams"]
