"""Engines that restore their step programs: a small tiny-model engine, its greedy tokens, and an executable
cache in a directory of the test's (the start-up and background-restore tests)."""

from __future__ import annotations

from jaxmamba import LLM, SamplingParams, compile_cache
from jaxmamba.compile_cache import ExecutableCache

PROMPTS = [[5, 6, 7], [1, 17, 42, 7, 99, 3, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def small_engine(checkpoint, **kw) -> LLM:
    return LLM(checkpoint, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, compile_progress=False, **kw)


def greedy_tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def executables_in(monkeypatch, directory) -> None:
    """Engines of this test keep their executables in ``directory`` (the engine argument still switches it)."""
    monkeypatch.setattr(compile_cache, "executable_cache_for", lambda _dir, enabled=None: (
        ExecutableCache(directory) if compile_cache.executable_cache_enabled(enabled) else None))
