"""JAX's persistent compilation cache for the engine's step programs.

An engine compiles one program per bucket at start-up (and per sampling variant): ~3 s a bucket for the
tiny default on this CPU, ~5.6 s on an H100 (XLA's GPU pipeline, 2026-11-27), minutes for an 8B model's
bucket set. vLLM keeps its compiled graphs under ``~/.cache/vllm``; we keep XLA's executables under
``~/.cache/jaxmamba/xla`` so that a restart with the same model, buckets, flags and jax loads them
instead (JAX keys each entry by the program, the device and the compile options).

The cache is process-wide JAX state: an engine turns it on only where nobody has configured one, and a
directory set by the user (``jax.config`` or ``JAX_COMPILATION_CACHE_DIR``) always wins.

JAX's cache still traces and lowers every program before it can look it up (its key is the lowered
program), which for an engine's step set is most of a warm start; ``ExecutableCache`` keeps the step
executables themselves, serialised, under a key that names everything they depend on, so that a warm start
restores them without tracing anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import threading
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


# ---------------------------------------------------------------------------------------------- executables
#: Subdirectory of the compilation cache where ``ExecutableCache`` keeps serialised step programs.
EXECUTABLES_SUBDIR = "jaxmamba-steps"
_MAGIC = b"jaxmamba-executable-v1\n"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the ``jaxmamba`` package: a step program depends on the code that traced
    it (the model, the kernels, the metadata layout), so any edit invalidates every stored executable."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_key() -> dict:
    """What every executable depends on besides its own program: jax, the device and the compiler's flags."""
    import jaxlib

    device = jax.devices()[0]
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": device.platform,
            "device_kind": device.device_kind, "num_devices": jax.device_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision), "source": source_digest()}


class ExecutableCache:
    """Serialised step executables (``jax.experimental.serialize_executable``) under one directory, one file per
    key: a warm start loads them whole, with no tracing, lowering or backend compile.

    The key is the SHA-256 of a description of everything the program depends on (``environment_key`` and
    the caller's description of the program: shapes, dtypes, bucket, layout, options). A file holds its key
    and a digest of its payload: a file that is truncated, corrupt, written for another key or that the
    runtime refuses to load is reported as a miss (``load`` returns None, and the caller compiles and stores
    it again), never loaded wrongly."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rejected: list[str] = []  # why entries were not loaded (corrupt, foreign, refused)

    @staticmethod
    def key(description: dict) -> str:
        """The cache key of a program described by ``description`` (JSON-able values or their ``repr``)."""
        text = json.dumps({"env": environment_key(), "program": description}, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.exe"

    def contains(self, key: str) -> bool:
        """Whether an entry exists under ``key`` (``load`` may still reject it)."""
        return self._path(key).exists()

    def load(self, key: str):
        """``(executable, extra)`` stored under ``key``, or None (absent, or rejected: see ``rejected``)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            header_len = len(_MAGIC) + 64 + 64
            if len(data) < header_len or not data.startswith(_MAGIC):
                raise ValueError("not an executable file (truncated?)")
            stored_key = data[len(_MAGIC): len(_MAGIC) + 64].decode()
            stored_digest = data[len(_MAGIC) + 64: header_len].decode()
            payload = data[header_len:]
            if stored_key != key:
                raise ValueError(f"written for key {stored_key[:12]}")
            if hashlib.sha256(payload).hexdigest() != stored_digest:
                raise ValueError("payload digest mismatch (truncated or corrupt)")
            serialized, in_tree, out_tree, extra = pickle.loads(payload)
            return deserialize_and_load(serialized, in_tree, out_tree), extra
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss, recompiled and rewritten
            self.rejected.append(f"{path.name}: {e}")
            return None

    def store(self, key: str, executable, extra=None) -> None:
        """Serialise ``executable`` (with picklable ``extra``) under ``key``; written atomically. A failure
        to serialise or write only costs the next start a compile."""
        from jax.experimental.serialize_executable import serialize

        try:
            serialized, in_tree, out_tree = serialize(executable)
            payload = pickle.dumps((serialized, in_tree, out_tree, extra))
        except Exception as e:  # noqa: BLE001 - some executables (host callbacks) cannot be serialised
            self.rejected.append(f"{key[:12]}: not serialisable ({e})")
            return
        data = _MAGIC + key.encode() + hashlib.sha256(payload).hexdigest().encode() + payload
        tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            self.rejected.append(f"{key[:12]}: not written ({e})")
            tmp.unlink(missing_ok=True)


#: Opt-in switch of the executable cache (``1``). Off by default: on jax 0.10.2's CPU client an executable
#: restored from it can fail to run ("Function ... not found") when JAX's persistent cache was in use in the
#: process that stored it; until that is understood, a warm start relies on JAX's persistent cache.
EXECUTABLE_CACHE_ENV_VAR = "JAXMAMBA_EXECUTABLE_CACHE"


def executable_cache_for(compile_cache_dir: Path | None) -> ExecutableCache | None:
    """The engine's executable cache inside the compilation cache directory (None: no cache in use, or the
    cache not switched on with ``JAXMAMBA_EXECUTABLE_CACHE=1``)."""
    if compile_cache_dir is None or os.environ.get(EXECUTABLE_CACHE_ENV_VAR) != "1":
        return None
    try:
        return ExecutableCache(Path(compile_cache_dir) / EXECUTABLES_SUBDIR)
    except OSError:
        return None
