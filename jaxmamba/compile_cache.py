"""JAX's persistent compilation cache for the engine's step programs.

An engine compiles one program per bucket at start-up (and per sampling variant): ~3 s a bucket for the
tiny default on this CPU, ~5.6 s on an H100 (XLA's GPU pipeline, 2026-11-27), minutes for an 8B model's
bucket set. vLLM keeps its compiled graphs under ``~/.cache/vllm``; we keep XLA's executables under
``~/.cache/jaxmamba/xla`` so that a restart with the same model, buckets, flags and jax loads them
instead (JAX keys each entry by the program, the device and the compile options).

The cache is process-wide JAX state: an engine turns it on only where nobody has configured one, and a
directory set by the user (``jax.config`` or ``JAX_COMPILATION_CACHE_DIR``) always wins.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxmamba.errors import ConfigError

#: Environment override of ``LLM(compile_cache="auto")``: a directory, or ``none`` to leave the cache off.
ENV_VAR = "JAXMAMBA_COMPILE_CACHE"
DEFAULT_DIR = Path.home() / ".cache" / "jaxmamba" / "xla"
_OFF = ("", "none", "off")


def enable_compile_cache(compile_cache: str | os.PathLike | None = "auto") -> Path | None:
    """Turn on JAX's persistent compilation cache; return the directory in use (None: off).

    ``compile_cache``: ``"auto"`` (``$JAXMAMBA_COMPILE_CACHE``, else ``~/.cache/jaxmamba/xla``), a
    directory, or None / ``"none"`` (leave JAX's setting as it is). A cache directory already configured
    in JAX is kept and returned: the engine never moves a cache the user chose.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if compile_cache is None:
        return None
    choice = os.environ.get(ENV_VAR, str(DEFAULT_DIR)) if compile_cache == "auto" else os.fspath(compile_cache)
    if choice.strip().lower() in _OFF:
        return None
    path = Path(choice).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compile_cache={choice!r}: cannot create the directory ({e}); pass another "
                          f"directory, or None (or {ENV_VAR}=none) to run without a compilation cache") from e
    # JAX opens the cache at the first compile that finds a directory set, so programs compiled
    # before this call (a weight cast, the user's own jit) do not keep it off (tested, jax 0.10/0.11).
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
