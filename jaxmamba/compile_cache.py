"""JAX's persistent compilation cache for the engine's step programs, and ``ExecutableCache``.

The persistent cache keeps XLA's executables under ``~/.cache/jaxmamba/xla`` (as vLLM's
``~/.cache/vllm``), turned on only where nobody configured one (``jax.config`` or
``JAX_COMPILATION_CACHE_DIR`` wins). ``ExecutableCache`` (on by default; ``JAXMAMBA_EXECUTABLE_CACHE=0``
or ``LLM(executable_cache=False)`` turns it off) keeps the step executables themselves, serialised, under
a key naming everything they depend on, so a warm start restores them without tracing, lowering or
compiling. A persistent-cache hit is stored from its entry's bytes (``persistent_cache_reads``), and an
entry without machine code is refused at store and at load (``_lacks_object_code``). Why, and start-up
costs: docs/architecture.md, "Compilation caches".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxmamba import cpu_heap
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
_MAGIC = b"jaxmamba-executable-v2\n"
#: jax configuration that changes what a traced program lowers to (beyond the program's own description).
_LOWERING_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                    "jax_threefry_partitionable", "jax_use_shardy_partitioner", "jax_numpy_dtype_promotion",
                    "jax_pallas_use_mosaic_gpu")


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``.py`` file of the ``jaxmamba`` package: a step program depends on the code that traced
    it (the model, the kernels, the metadata layout), so any edit invalidates every stored executable."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The host CPU's model and feature flags: XLA's CPU backend compiles for the host's instruction set, so an
    executable written on one machine (a home directory shared between hosts) may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def environment_key() -> dict:
    """What every executable depends on besides its own program: jax, jaxlib, flax, the code, the device (and
    on the CPU the host's instruction set), the compiler's flags and the jax settings that change lowering."""
    import flax
    import jaxlib

    device = jax.devices()[0]
    key = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
           "platform": device.platform, "platform_version": getattr(device.client, "platform_version", ""),
           "device_kind": device.device_kind, "num_devices": jax.device_count(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "source": source_digest(),
           "config": {name: str(getattr(jax.config, name, None)) for name in _LOWERING_CONFIG}}
    if device.platform == "cpu":
        key["host_cpu"] = _host_cpu()
    else:
        key["compute_capability"] = str(getattr(device, "compute_capability", ""))
    return key


def _lacks_object_code(serialized: bytes) -> bool:
    """Whether a serialised CPU executable is missing its machine code: XLA's CPU client (jax 0.10.2)
    serialises an executable it deserialised (a JAX persistent-cache hit) without the object files it was
    loaded from, and the restored copy then fails to run ("Function ... not found"). A CPU executable
    carries its kernels as ELF (Linux) or Mach-O (macOS) objects; elsewhere nothing is checked."""
    if jax.default_backend() != "cpu" or sys.platform not in ("linux", "darwin"):
        return False
    return b"\x7fELF" not in serialized and b"\xcf\xfa\xed\xfe" not in serialized


# What a persistent-cache hit returns is a deserialised executable, which XLA's CPU client re-serialises without
# its machine code; the bytes of the cache entry it came from carry that code. JAX parses every entry it reads
# with ``compilation_cache.extract_executable_and_time``: wrapped, it hands the bytes to a thread that asked.
_reads = threading.local()
_wrap_lock = threading.Lock()


def _wrap_jax_cache_function(name: str, make_wrapper: Callable) -> bool:
    """Replace jax's ``compilation_cache.<name>`` by ``make_wrapper(original)`` (once per process); False where
    this jax has no such function."""
    try:
        from jax._src import compilation_cache as jax_cache
    except ImportError:
        return False
    with _wrap_lock:
        original = getattr(jax_cache, name, None)
        if original is None:
            return False
        if not getattr(original, "_jaxmamba_wrapper", False):
            wrapper = functools.wraps(original)(make_wrapper(original))
            wrapper._jaxmamba_wrapper = True
            setattr(jax_cache, name, wrapper)
        return True


def _install_read_capture() -> bool:
    """Wrap jax's ``compilation_cache.extract_executable_and_time`` (once) so that the serialised executable of
    each entry read on a thread inside ``persistent_cache_reads`` is kept there; False where this jax has no
    such function (then a persistent-cache hit is not stored)."""

    def capturing(original):
        def extract_executable_and_time(entry):
            serialized, compile_time = original(entry)
            reads = getattr(_reads, "active", None)
            if reads is not None:
                reads.serialized = serialized
                reads.count += 1
            return serialized, compile_time
        return extract_executable_and_time

    return _wrap_jax_cache_function("extract_executable_and_time", capturing)


class persistent_cache_reads:  # noqa: N801 - a context manager, named as contextlib's are
    """Inside, the serialised executable of the last entry JAX's persistent cache returned on this thread is
    ``serialized`` (None: none read): the executable to store when a compile was answered by that cache;
    ``count``: how many entries were read (more than one: ``serialized`` may be another program's)."""

    def __enter__(self):
        self.serialized: bytes | None = None
        self.count = 0
        self.available = _install_read_capture()
        self._outer = getattr(_reads, "active", None)
        _reads.active = self
        return self

    def __exit__(self, *exc):
        _reads.active = self._outer
        return False


def _serialize(compiled, serialized_executable: bytes | None = None):
    """``jax.experimental.serialize_executable.serialize(compiled)``; with ``serialized_executable`` (the XLA
    executable's bytes as JAX's persistent cache holds them) those bytes stand for its executable instead of
    what the runtime would serialise now."""
    from jax.experimental import serialize_executable as se

    if serialized_executable is None:
        return se.serialize(compiled)
    import io

    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc

    class Pickler(se._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, (xc.LoadedExecutable, _jax.Executable)):
                return ("exec", serialized_executable)
            return super().persistent_id(obj)

    # As serialize() does (jax 0.10, 0.11).
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or compiled._params.const_args:
        raise ValueError("this executable does not serialise")
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as file:
        Pickler(file).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return file.getvalue(), in_tree, compiled.out_tree


# JAX decides once per process whether its persistent cache is in use (``compilation_cache.is_cache_used``
# remembers its first answer): ``jax_enable_compilation_cache`` set to False later does not stop a compile from
# reading and writing it, and set so around the process's first compile it turns the cache off for good.
_bypass = threading.local()


def _install_bypass() -> bool:
    """Wrap jax's ``compilation_cache.is_cache_used`` (once) to answer False on a thread inside
    ``without_persistent_cache``; False where this jax has no such function."""

    def bypassing(original):
        def is_cache_used(backend) -> bool:
            return False if getattr(_bypass, "active", False) else original(backend)
        return is_cache_used

    return _wrap_jax_cache_function("is_cache_used", bypassing)


class without_persistent_cache:  # noqa: N801 - a context manager, named as contextlib's are
    """Inside, this thread's compiles neither read nor write JAX's persistent compilation cache (a deviceless
    GPU-target compile: an entry would skip ptxas, whose statistics it reports, and cannot be loaded without the
    device). Other threads, and this one afterwards, use the cache as configured."""

    def __enter__(self):
        self.bypassed = _install_bypass()
        self._outer = getattr(_bypass, "active", False)
        _bypass.active = True
        return self

    def __exit__(self, *exc):
        _bypass.active = self._outer
        return False


class ExecutableCache:
    """Serialised step executables (``jax.experimental.serialize_executable``) under one directory, one file per
    key: a warm start loads them whole, with no tracing, lowering or backend compile.

    The key is the SHA-256 of a description of everything the program depends on (``environment_key`` and
    the caller's description of the program: shapes, dtypes, bucket, layout, options). A file holds its key
    and a digest of its payload: a file that is truncated, corrupt, written for another key, that holds a CPU
    executable without its machine code or that the runtime refuses to load is reported as a miss (``load``
    returns None, and the caller compiles and stores it again), never loaded wrongly. What is stored is an
    executable XLA compiled in this process, or one JAX's persistent cache returned stored from the bytes of
    its entry (``persistent_cache_reads``; ``ProgramBuilder`` chooses)."""

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

    def entry_size(self, key: str) -> int:
        """Bytes of the entry under ``key``; 0 when absent."""
        try:
            return self._path(key).stat().st_size
        except OSError:
            return 0

    def load(self, key: str):
        """``(executable, extra)`` stored under ``key``, or None (absent, or rejected: see ``rejected``)."""
        entry = self.read(key)
        return None if entry is None else self.deserialize(key, entry)

    def read(self, key: str) -> tuple | None:
        """The entry under ``key``, checked (its header, key and digest) but not yet deserialised:
        ``(serialized, in_tree, out_tree, extra)`` for ``deserialize``, or None (absent, or rejected: see
        ``rejected``). Cheap: a 21M engine's 15 entries in 0.07-0.24 s, against 5-10 s to deserialise them
        (XLA's rebuild is what a restore costs)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            header_len = len(_MAGIC) + 64 + 64
            if len(data) < header_len or not data.startswith(_MAGIC):
                raise ValueError("not an executable file of this version (truncated?)")
            stored_key = data[len(_MAGIC): len(_MAGIC) + 64].decode()
            stored_digest = data[len(_MAGIC) + 64: header_len].decode()
            payload = data[header_len:]
            if stored_key != key:
                raise ValueError(f"written for key {stored_key[:12]}")
            if hashlib.sha256(payload).hexdigest() != stored_digest:
                raise ValueError("payload digest mismatch (truncated or corrupt)")
            entry = pickle.loads(payload)
            if _lacks_object_code(entry[0]):
                raise ValueError("no object code (serialised from a deserialised executable)")
            return entry
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss, recompiled and rewritten
            self.rejected.append(f"{path.name}: {e}")
            return None

    def deserialize(self, key: str, entry: tuple):
        """``(executable, extra)`` from ``read``'s ``entry``, or None where the runtime refuses it (see
        ``rejected``)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        serialized, in_tree, out_tree, extra = entry
        try:
            with cpu_heap.fastbins_off():
                return deserialize_and_load(serialized, in_tree, out_tree), extra
        except Exception as e:  # noqa: BLE001 - an entry the runtime refuses is a miss, recompiled and rewritten
            self.rejected.append(f"{self._path(key).name}: {e}")
            return None

    def store(self, key: str, executable, extra=None, *, serialized_executable: bytes | None = None) -> bool:
        """Serialise ``executable`` (with picklable ``extra``) under ``key``; written atomically. Returns whether
        it was; a failure to serialise or write only costs the next start a compile. ``serialized_executable``:
        the XLA executable's bytes from JAX's persistent cache, for an executable that cache returned."""
        try:
            serialized, in_tree, out_tree = _serialize(executable, serialized_executable)
            if _lacks_object_code(serialized):
                raise ValueError("no object code: a deserialised executable (JAX's persistent cache answered)")
            payload = pickle.dumps((serialized, in_tree, out_tree, extra))
        except Exception as e:  # noqa: BLE001 - some executables (host callbacks) cannot be serialised
            self.rejected.append(f"{key[:12]}: not stored ({e})")
            return False
        data = _MAGIC + key.encode() + hashlib.sha256(payload).hexdigest().encode() + payload
        tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            self.rejected.append(f"{key[:12]}: not written ({e})")
            tmp.unlink(missing_ok=True)
            return False
        return True


#: Off switch of the executable cache: ``JAXMAMBA_EXECUTABLE_CACHE=0`` (or ``off``/``none``/``false``), or
#: ``LLM(executable_cache=False)``. On by default, on every platform: what made restored executables fail
#: on jax 0.10.2's CPU client (an executable JAX's persistent cache had answered serialises without its
#: machine code) is avoided where it arises, by storing such an executable from its cache entry's bytes
#: (``persistent_cache_reads``), and caught where it would show (``_lacks_object_code``, at store and load).
EXECUTABLE_CACHE_ENV_VAR = "JAXMAMBA_EXECUTABLE_CACHE"
_ENV_OFF = ("0", "off", "none", "false", "no")


def executable_cache_enabled(setting: bool | None = None) -> bool:
    """``setting`` (the engine argument) if given, else ``$JAXMAMBA_EXECUTABLE_CACHE`` (on unless ``0``)."""
    if setting is not None:
        return bool(setting)
    return os.environ.get(EXECUTABLE_CACHE_ENV_VAR, "1").strip().lower() not in _ENV_OFF


def executable_cache_for(compile_cache_dir: Path | None, enabled: bool | None = None) -> ExecutableCache | None:
    """The engine's executable cache inside the compilation cache directory (None: no cache directory in use,
    or the executable cache switched off: ``executable_cache_enabled``)."""
    if compile_cache_dir is None or not executable_cache_enabled(enabled):
        return None
    try:
        return ExecutableCache(Path(compile_cache_dir) / EXECUTABLES_SUBDIR)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- compiling
def compile_and_store(compile: Callable[[object], tuple[object, object]], lowered, cache=None,
                      cache_key: str | None = None) -> tuple[object, object, float, bool]:
    """``compile(lowered)`` -> ``(executable, extra)``, kept in ``cache`` under ``cache_key`` (if both given);
    returns ``(executable, extra, seconds, from_cache)``, ``from_cache``: XLA did not compile it (JAX's
    persistent or in-memory cache answered)."""
    CompileCounter.install()
    t0 = time.perf_counter()
    compiles_before = CompileCounter.on_this_thread()
    hits_before = CompileCounter.jax_cache_hits_on_this_thread()
    with persistent_cache_reads() as reads:
        executable, extra = compile(lowered)
    seconds = time.perf_counter() - t0
    # jax reports a compile its persistent cache answered as a backend compile too (the event wraps the
    # cache lookup) plus a cache hit; one its in-memory cache answered reports nothing.
    jax_cache_hit = CompileCounter.jax_cache_hits_on_this_thread() > hits_before
    from_cache = jax_cache_hit or CompileCounter.on_this_thread() == compiles_before
    if cache is not None and cache_key is not None:
        # What a cache returned is a deserialised executable, which XLA's CPU client (jax 0.10.2) serialises
        # without its machine code ("Function ... not found" when the restored copy runs): a persistent-
        # cache hit is stored from its entry's bytes, an in-memory hit (whose origin is unknown) not at all.
        if not from_cache:
            cache.store(cache_key, executable, extra)
        elif jax_cache_hit and _entry_is_for(reads, lowered):
            cache.store(cache_key, executable, extra, serialized_executable=reads.serialized)
    return executable, extra, seconds, from_cache


def _entry_is_for(reads: persistent_cache_reads, lowered) -> bool:
    """Whether the one entry read during a compile is that program's: a ``compile`` that also ran another
    program (an array made on the way) could have read that one's entry instead, and storing it under this
    program's key would restore the wrong executable (the test of truncated entries once did so). The entry
    must be the only one read and carry the lowered module's name."""
    if reads.count != 1 or reads.serialized is None:
        return False
    try:
        name = str(lowered.compiler_ir().operation.attributes["sym_name"]).strip('"')
    except Exception:  # noqa: BLE001 - not a jax Lowered: its origin cannot be checked, so it is not stored
        return False
    return name.encode() in reads.serialized


def build_one(lower: Callable[[], object], *, cache=None, description: dict | None = None):
    """One small program built outside a step set (a device table's scatters, the caches' allocator): restored
    whole from ``cache`` (a ``compile_cache.ExecutableCache``) when it holds ``description``'s key, else lowered
    and compiled (and kept there). ``description`` names everything the program depends on besides the code,
    jax and the device (``ExecutableCache.key``); None: never cached."""
    # One local device only, as the step programs (a deserialised executable loads onto every local device).
    key = (cache.key(description) if cache is not None and description is not None and jax.local_device_count() == 1
           else None)
    if key is not None:
        hit = cache.load(key)
        if hit is not None:
            return hit[0]
    return compile_and_store(lambda lowered: (lowered.compile(), None), lower(), cache, key)[0]


#: jax.monitoring's event for a compile that JAX's persistent compilation cache answered (jax 0.10, 0.11).
JAX_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


#: jax.monitoring's duration events of a lowering (jaxpr -> StableHLO) and of a backend compile (jax 0.10, 0.11).
JAX_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
JAX_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compilations and lowerings process-wide through jax.monitoring; ``background`` counts the
    compiles made on the program builder's threads (``jaxmamba-*``: a lazy build's compiles run beside serving);
    per thread, the compiles and JAX's persistent-cache hits (jax reports both on the thread that asked for the
    compile)."""

    _lock = threading.Lock()
    count = 0
    background = 0
    lowerings = 0
    _installed = False
    _thread = threading.local()  # this thread's backend compilations (jax reports a compile on its thread)

    @classmethod
    def on_this_thread(cls) -> int:
        return getattr(cls._thread, "count", 0)

    @classmethod
    def jax_cache_hits_on_this_thread(cls) -> int:
        return getattr(cls._thread, "jax_cache_hits", 0)

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration: float, **kwargs) -> None:
                if event == JAX_BACKEND_COMPILE_EVENT:
                    cls._thread.count = cls.on_this_thread() + 1
                    with cls._lock:
                        cls.count += 1
                        if threading.current_thread().name.startswith("jaxmamba-"):
                            cls.background += 1
                elif event == JAX_LOWERING_EVENT:
                    with cls._lock:
                        cls.lowerings += 1

            def hit_listener(event: str, **kwargs) -> None:
                if event == JAX_CACHE_HIT_EVENT:
                    cls._thread.jax_cache_hits = cls.jax_cache_hits_on_this_thread() + 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            jax.monitoring.register_event_listener(hit_listener)
            cls._installed = True
