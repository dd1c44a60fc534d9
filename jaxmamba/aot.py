"""Compile for a GPU that is not here: compile-only CUDA targets, their memory, their kernels' registers.

``get_target`` / ``target_device`` / ``on_target`` describe a compile-only CUDA target;
``compile_for_target`` lowers and compiles for it and returns the executable's ``MemoryStats`` and a
``KernelStats`` per Pallas kernel; ``ptxas_environment`` sets up the register report. How and what it
checks: docs/architecture.md, "Compiling for a GPU that is not here".
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from jaxmamba.errors import ConfigError

TARGETS_DIR = Path(__file__).resolve().parent / "targets"

#: XLA's backend optimisation level for target compiles: production's, whatever the process's
#: XLA_FLAGS say (the CPU test suite compiles at level 0; ptxas numbers must not follow it).
TARGET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 3}

AOT_INSTALL_HINT = 'pip install -e ".[aot]"  (jax-cuda12-plugin/-pjrt matching jax, nvidia-cuda-nvcc-cu12)'

_PTXAS_LOG_ENV = "JAXMAMBA_PTXAS_LOG"


# ---------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class GpuTarget:
    """Facts of one GPU model (from ``targets/<name>.txtpb``)."""

    name: str
    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int  # device memory (HBM)
    memory_bandwidth: int  # bytes / s
    shared_memory_per_block_optin: int  # the most a kernel may opt into, bytes
    shared_memory_per_sm: int
    registers_per_sm: int
    registers_per_block: int
    clock_ghz: float
    config_text: str  # the GpuTargetConfigProto handed to XLA

    @property
    def sm_arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def target_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb")))


def _field(text: str, name: str, cast=int):
    m = re.search(rf"^\s*{name}:\s*\"?([^\"\n]+)\"?\s*$", text, re.MULTILINE)
    if m is None:
        raise ConfigError(f"target description lacks {name!r}")
    return cast(m.group(1))


@functools.lru_cache(maxsize=None)
def get_target(name: str) -> GpuTarget:
    """The ``GpuTarget`` called ``name`` (``h100``, ``h200``); ``ConfigError`` names the known ones."""
    path = TARGETS_DIR / f"{str(name).lower()}.txtpb"
    if not path.is_file():
        raise ConfigError(f"unknown target {name!r}: known targets are {', '.join(target_names())}")
    text = path.read_text()
    cc = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
    return GpuTarget(
        name=path.stem, description=_field(text, "device_description_str", str),
        compute_capability=(int(cc.group(1)), int(cc.group(2))), sm_count=_field(text, "core_count"),
        memory_bytes=_field(text, "device_memory_size"), memory_bandwidth=_field(text, "memory_bandwidth"),
        shared_memory_per_block_optin=_field(text, "shared_memory_per_block_optin"),
        shared_memory_per_sm=_field(text, "shared_memory_per_core"),
        registers_per_sm=_field(text, "registers_per_core_limit"),
        registers_per_block=_field(text, "registers_per_block_limit"),
        clock_ghz=_field(text, "clock_rate_ghz", float), config_text=text,
    )


def aot_available() -> bool:
    """Whether the ``aot`` extra is installed (jax's CUDA plugin and the nvcc wheel)."""
    return all(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "nvidia.cuda_nvcc"))


def require_aot() -> None:
    if not aot_available():
        raise ConfigError(f"compiling for a GPU target needs the aot extra: {AOT_INSTALL_HINT}")


@functools.lru_cache(maxsize=None)
def target_device(name: str):
    """The compile-only device of target ``name`` (a ``jax.Device`` that compiles but never runs)."""
    require_aot()
    from jax.experimental import topologies

    target = get_target(name)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.config_text, topology="1x1x1")
    except NotImplementedError:
        # jax drops its CUDA plugin when it fails to start one on a machine without a GPU.
        raise ConfigError("jax's CUDA plugin is not loaded: on a machine without a GPU set JAX_PLATFORMS=cpu "
                          "before jax is imported (python -m jaxmamba plan does)") from None
    return topology.devices[0]


_default_device_lock = threading.RLock()


@contextlib.contextmanager
def on_target(name: str):
    """Make the target's compile-only device jax's default device while lowering and compiling."""
    import jax

    device = target_device(name)
    with _default_device_lock:
        previous = jax.config.jax_default_device
        jax.config.update("jax_default_device", device)
        try:
            yield device
        finally:
            jax.config.update("jax_default_device", previous)


def abstract_on(tree, device):
    """``tree`` (arrays or ``ShapeDtypeStruct``s) as ``ShapeDtypeStruct``s placed on ``device``."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


# ---------------------------------------------------------------------------------------------- stats
@dataclass(frozen=True)
class MemoryStats:
    """XLA's buffer assignment of one executable (bytes)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated arguments
    temp_bytes: int

    @classmethod
    def of(cls, compiled) -> "MemoryStats":
        m = compiled.memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes))

    @property
    def peak_bytes(self) -> int:
        """Arguments, fresh outputs and temporaries live at once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclass(frozen=True)
class KernelStats:
    """One Triton kernel as ptxas and XLA's launch saw it."""

    name: str
    registers: int | None  # per thread; None when ptxas' log was not captured (see ptxas_environment)
    spill_bytes: int | None  # spill stores + spill loads
    shared_bytes: int  # dynamic shared memory of the launch
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    pallas: bool  # a Pallas (Triton) kernel, not one of XLA's own fusions


@dataclass(frozen=True)
class TargetCompile:
    target: str
    memory: MemoryStats
    kernels: tuple[KernelStats, ...]
    compiled: object  # the jax ``Compiled`` (compile-only: it cannot run)


def ptxas_environment(directory: str | os.PathLike | None = None) -> dict[str, str]:
    """Write a ``ptxas`` wrapper (adds ``-v``, logs its report) over the nvcc wheel's ptxas; return the
    environment variables that make XLA use it. They must be set before jax is imported."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"ptxas statistics need the nvcc wheel: {AOT_INSTALL_HINT}")
    nvcc = Path(list(spec.submodule_search_locations)[0])
    root = Path(directory or tempfile.mkdtemp(prefix="jaxmamba-ptxas-"))
    (root / "bin").mkdir(parents=True, exist_ok=True)
    log = root / "ptxas.log"
    wrapper = root / "bin" / "ptxas"
    wrapper.write_text(f'#!/bin/sh\nexec "{nvcc / "bin" / "ptxas"}" -v "$@" 2>>"{log}"\n')
    wrapper.chmod(0o755)
    if not (root / "nvvm").exists():
        (root / "nvvm").symlink_to(nvcc / "nvvm")
    return {"CUDA_ROOT": str(root), _PTXAS_LOG_ENV: str(log)}


def ptxas_log_path() -> Path | None:
    """The wrapper's log when this process runs with ``ptxas_environment()``'s variables."""
    log = os.environ.get(_PTXAS_LOG_ENV)
    if log and Path(os.environ.get("CUDA_ROOT", "")) == Path(log).parent:
        return Path(log)
    return None


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+)\s+grid:\s*\[([^\]]*)\]\s+threads:\s*\[([^\]]*)\]\s+"
                    r"shared_memory:\s*(\d+) bytes")

_TRITON_CALL_NAME = re.compile(r'__gpu\$xla\.gpu\.triton.*?name = "([^"]+)"')

#: ptxas reports by kernel name, over the whole process: XLA compiles a kernel it has seen once.
_ptxas_seen: dict[str, tuple[int, int]] = {}


def parse_ptxas_log(text: str) -> dict[str, tuple[int, int]]:
    """``{entry: (registers, spill_bytes)}`` from ``ptxas -v`` output."""
    out, entry, spill = {}, None, 0
    for line in text.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            entry, spill = m.group(1), 0
        elif (m := _PTXAS_SPILL.search(line)) and entry:
            spill = int(m.group(1)) + int(m.group(2))
        elif (m := _PTXAS_REGS.search(line)) and entry:
            out[entry] = (int(m.group(1)), spill)
            entry = None
    return out


def parse_thunk_sequence(text: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """Custom (Triton) kernel launches of an XLA dump's ``thunk_sequence.txt``: name, grid, threads, shared bytes."""
    ints = lambda s: tuple(int(v) for v in s.replace(",", " ").split())  # noqa: E731
    return [(m.group(1), ints(m.group(2)), ints(m.group(3)), int(m.group(4))) for m in _THUNK.finditer(text)]


def compile_for_target(fn, *abstract_args, target: str = "h100", donate_argnums=(), fail_on_spill: bool = False,
                       static_argnums=()) -> TargetCompile:
    """Lower ``fn`` (a function or a ``jax.jit``) at ``abstract_args`` and compile it for ``target``.

    Array arguments may be arrays or ``ShapeDtypeStruct``s; they are placed on the target's device.
    ``fail_on_spill`` turns any register spill into a compile error (XLA's
    ``xla_gpu_fail_ptx_compilation_on_register_spilling``).
    """
    lowered = lower_for_target(fn, *abstract_args, target=target, donate_argnums=donate_argnums,
                               static_argnums=static_argnums)
    return compile_lowered_for_target(lowered, target, fail_on_spill=fail_on_spill)


def lower_for_target(fn, *abstract_args, target: str = "h100", donate_argnums=(), static_argnums=()):
    """``compile_for_target``'s first half: ``fn`` traced and lowered on ``target``'s compile-only device."""
    import jax

    device = target_device(target)
    args = abstract_on(abstract_args, device)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums)
    with on_target(target):
        return jitted.lower(*args)


def compile_lowered_for_target(lowered, target: str = "h100", fail_on_spill: bool = False) -> TargetCompile:
    """``compile_for_target``'s second half: XLA's compile of a ``lower_for_target`` result, with its memory
    and kernel statistics. Safe to run on several threads at once (each compile dumps to its own directory).
    JAX's persistent cache is bypassed on this thread: an entry would skip ptxas (no statistics) and cannot be
    loaded without the device ("PjRtCompiler must be constructed with a Client")."""
    from jaxmamba.compile_cache import without_persistent_cache

    log = ptxas_log_path()
    log_start = log.stat().st_size if log is not None and log.exists() else 0
    options = dict(TARGET_COMPILER_OPTIONS)
    if fail_on_spill:
        options["xla_gpu_fail_ptx_compilation_on_register_spilling"] = True
    with tempfile.TemporaryDirectory(prefix="jaxmamba-aot-") as dump:
        options["xla_dump_to"] = dump
        with without_persistent_cache():
            compiled = lowered.compile(compiler_options=options)
        launches = []
        for path in sorted(Path(dump).glob("*thunk_sequence.txt")):
            launches += parse_thunk_sequence(path.read_text())
    if log is not None and log.exists():
        with open(log) as f:
            f.seek(log_start)
            _ptxas_seen.update(parse_ptxas_log(f.read()))
    pallas_names = set(_TRITON_CALL_NAME.findall(lowered.as_text()))
    kernels = []
    for name, grid, threads, shared in launches:
        registers, spill = _ptxas_seen.get(name, (None, None))
        kernels.append(KernelStats(name, registers, spill, shared, grid, threads, name in pallas_names))
    return TargetCompile(target, MemoryStats.of(compiled), tuple(kernels), compiled)


def check_kernels_fit(kernels, target: str = "h100") -> list[str]:
    """Problems of ``kernels`` on ``target``: spills, shared memory over the opt-in limit, registers over 255."""
    limit = get_target(target).shared_memory_per_block_optin
    problems = []
    for k in kernels:
        if k.spill_bytes:
            problems.append(f"{k.name}: {k.spill_bytes} bytes of register spills ({k.registers} registers)")
        if k.shared_bytes > limit:
            problems.append(f"{k.name}: {k.shared_bytes} bytes of shared memory > {limit} ({target} opt-in limit)")
        if k.registers is not None and k.registers > 255:
            problems.append(f"{k.name}: {k.registers} registers > 255")
    return problems
