"""The engine's persistent compilation cache: a restart loads its step programs instead of compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from jaxmamba.compile_cache import (ENV_VAR, EXECUTABLE_CACHE_ENV_VAR, EXECUTABLES_SUBDIR,
                                    enable_compile_cache)
from jaxmamba.errors import ConfigError
from jaxmamba.random_checkpoint import random_model

REPO = Path(__file__).resolve().parents[2]

# A user's own jit runs before the engine exists (so JAX has already decided, once, whether a cache
# is in use); then an engine with two buckets starts and serves one request.
ENGINE_START = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs compile in < 1 s
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    jax.jit(lambda x: x * 2)(jnp.ones(3)).block_until_ready()
    from jaxmamba import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32,
              buckets=[(2, 16), (16, 16)], sampling_variants="full")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert llm.runner.steps.wait_ready(300)  # programs still deserialising in the background (restore="background")
    print(json.dumps(dict(hits=events.count("/jax/compilation_cache/cache_hits"),
                          restored=llm.stats.num_programs_restored, compiled=llm.startup_times.num_compiled,
                          lowerings=llm.startup_times.lowerings,
                          all_compiles=llm.startup_times.total_backend_compiles,
                          tokens=out[0].outputs[0].token_ids, cache=str(llm.compile_cache_dir))))
""")


def _start(checkpoint, env):
    proc = subprocess.run([sys.executable, "-c", ENGINE_START, str(checkpoint)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_restarted_engine_loads_its_step_programs_from_the_cache(tmp_path):
    checkpoint = random_model("nemotron_h", path=tmp_path / "ckpt")
    cache = tmp_path / "xla"
    env = {**os.environ, ENV_VAR: str(cache), "PYTHONPATH": str(REPO)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop(EXECUTABLE_CACHE_ENV_VAR, None)
    first = _start(checkpoint, env)
    assert first["cache"] == str(cache)
    assert first["hits"] == 0
    assert list((cache / EXECUTABLES_SUBDIR).glob("*.exe")), "the first start kept no executables"
    assert (first["restored"], first["compiled"]) == (0, 2)
    # Both buckets' step programs come back whole from the executable cache (on by default): nothing traced,
    # lowered or compiled.
    second = _start(checkpoint, env)
    assert (second["restored"], second["compiled"], second["lowerings"], second["all_compiles"]) == (2, 0, 0, 0), second
    assert second["tokens"] == first["tokens"]
    # Switched off, a restart still finds every program in JAX's persistent cache (which the first start
    # filled too), and they compute the same.
    third = _start(checkpoint, {**env, EXECUTABLE_CACHE_ENV_VAR: "0"})
    assert (third["restored"], third["compiled"]) == (0, 2) and third["hits"] >= 3, third
    assert third["tokens"] == first["tokens"]


def test_a_cache_directory_the_user_configured_is_kept(tmp_path, monkeypatch):
    configured = jax.config.jax_compilation_cache_dir  # the test session's (tests/conftest.py)
    assert configured
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "elsewhere"))
    assert enable_compile_cache("auto") == Path(configured)
    assert enable_compile_cache(tmp_path / "other") == Path(configured)
    assert jax.config.jax_compilation_cache_dir == configured
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "other").exists()


def test_off_and_unusable_directories(tmp_path, monkeypatch):
    configured = jax.config.jax_compilation_cache_dir  # the test session's: off for this test
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert enable_compile_cache(None) is None
        monkeypatch.setenv(ENV_VAR, "none")
        assert enable_compile_cache("auto") is None
        assert not jax.config.jax_compilation_cache_dir
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        with pytest.raises(ConfigError, match="compile_cache=.*a-file/xla.*cannot create"):
            enable_compile_cache(blocker / "xla")
        assert not jax.config.jax_compilation_cache_dir
    finally:
        jax.config.update("jax_compilation_cache_dir", configured)


def test_without_persistent_cache_bypasses_it_on_this_thread_only():
    """JAX decides once per process whether its cache is in use: turning ``jax_enable_compilation_cache`` off
    later did not stop reads (a deviceless GPU-target compile then warned that it could not load an entry, and
    would have reported no ptxas statistics on a hit). ``without_persistent_cache`` bypasses it on one thread."""
    import jax.numpy as jnp

    from jaxmamba.compile_cache import persistent_cache_reads, without_persistent_cache

    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("needs the test session's JAX persistent cache (tests/conftest.py)")
    x = jnp.arange(5.0)
    program = lambda x: jnp.cos(x) * 3 - 1  # noqa: E731
    jax.jit(program).lower(x).compile()  # compiled and written, or already there
    jax.clear_caches()
    with without_persistent_cache(), persistent_cache_reads() as bypassed:
        jax.jit(program).lower(x).compile()
    assert bypassed.serialized is None  # compiled afresh: the cache was not read
    jax.clear_caches()
    with persistent_cache_reads() as after:
        jax.jit(program).lower(x).compile()
    assert after.serialized is not None  # outside, the cache answers again
