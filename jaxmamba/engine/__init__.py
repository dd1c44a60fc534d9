"""The serving engine: scheduler -> runner -> model, behind vLLM's ``LLM`` API."""

from jaxmamba.engine.llm import LLM, EngineStats
from jaxmamba.engine.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "EngineStats", "CompletionOutput", "RequestOutput", "SamplingParams"]
