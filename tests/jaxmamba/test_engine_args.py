"""``EngineConfig`` holds exactly ``LLM``'s engine arguments, validates them before any model loads, and the
engine classes stand as vLLM v1's: ``LLM`` -> ``LLMEngine`` -> ``EngineCore``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from jaxmamba import LLM
from jaxmamba.engine import EngineConfig
from jaxmamba.errors import ConfigError


def test_llm_takes_exactly_the_config_fields_with_the_same_defaults():
    params = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items() if n not in ("self", "model")}
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert params == fields


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs=0 must be > 0"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens=4 must be >= max_num_seqs=8"),
    (dict(mamba_cache_mode="align"), "does not fit enable_prefix_caching"),
    (dict(num_scheduler_steps=2, enable_prefix_caching=True), "num_scheduler_steps=2 needs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(dtype="int8"), "dtype="),
    (dict(compile="never"), "compile="),
    (dict(executable_cache="yes"), "executable_cache="),
])
def test_bad_arguments_fail_before_a_model_loads(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)
    with pytest.raises(ConfigError, match=match):
        LLM("/nonexistent/checkpoint", **kwargs)  # the path is never read


def test_config_is_normalised_and_frozen():
    c = EngineConfig(dtype="half", enable_prefix_caching=True, kernel_backend="auto")
    assert (c.dtype, c.mamba_cache_mode) == ("float16", "align")
    assert c.kernel_backend in ("reference", "pallas")
    assert dataclasses.replace(c) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_num_seqs = 4


def test_limits_for_prompts_size_a_one_shot_job_and_never_pass_the_defaults():
    from jaxmamba.buckets import default_buckets
    from jaxmamba.engine import limits_for_prompts  # the public name (README)

    # The CLI's three short prompts: a row each, their 13 tokens in one 16-token step; 4 buckets where the
    # defaults (8 rows, 256 tokens) have 9.
    limits = limits_for_prompts([6, 3, 4])
    assert limits == {"max_num_seqs": 3, "max_num_batched_tokens": 16}
    assert len(default_buckets(**limits)) == 4 < len(default_buckets(8, 256)) == 9
    assert limits_for_prompts([1]) == {"max_num_seqs": 1, "max_num_batched_tokens": 16}
    assert limits_for_prompts([100, 100]) == {"max_num_seqs": 2, "max_num_batched_tokens": 256}
    assert limits_for_prompts([17]) == {"max_num_seqs": 1, "max_num_batched_tokens": 32}  # the next rung
    # More prompts or tokens than the defaults hold: the defaults (longer prompts are chunked, as ever).
    assert limits_for_prompts([300] * 20) == {"max_num_seqs": 8, "max_num_batched_tokens": 256}
    for limits in (limits_for_prompts(n) for n in ([1] * 9, [3] * 5, [40, 2, 2], [255], [256], [257])):
        EngineConfig(**limits)  # every answer is a valid engine
        assert limits["max_num_seqs"] <= 8 and limits["max_num_batched_tokens"] <= 256
    for bad in ([], [0], [3, -1], [2.5]):
        with pytest.raises(ConfigError, match="prompt_lengths="):
            limits_for_prompts(bad)
