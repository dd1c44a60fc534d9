"""``jaxmamba.cpu_heap``: an XLA CPU program whose buffers pass glibc's 32 MiB mmap ceiling stops page-faulting
them afresh at every call once the engine has tuned the allocator (the full sampling tail ran 5-6x the greedy
one's time on the CPU for that reason alone)."""

import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Minor page faults of each of 40 calls of a program with a 40 MiB result and 96 MiB of temporaries (34000 pages of
# 4 KiB), after two warm-up calls; the allocator tuned or not (the environment variable the module honours).
# Tuned, the heap grows over the first calls (each growth faults the new pages once: XLA's threads free and
# allocate in varying order) and then serves every call from pages it already has, so the later calls count.
_FAULTS = textwrap.dedent("""
    import json, resource
    import jax, jax.numpy as jnp
    from jaxmamba.cpu_heap import keep_large_buffers_on_heap
    applied = keep_large_buffers_on_heap()
    x = jnp.ones((40, 1 << 18), jnp.float32)
    f = jax.jit(lambda x: jnp.cumsum(x * 2.0, axis=0)[::-1] + 1.0)
    for _ in range(2):
        jax.block_until_ready(f(x))
    faults = []
    for _ in range(40):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(f(x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"applied": applied, "faults": faults}))
""")


def _faults(tuned: bool) -> dict:
    # XLA_FLAGS without the suite's LLVM -O0 (tests/conftest.py, TEST_XLA_FLAGS): unoptimised, a call of this program
    # took ~2 s and the test 3 minutes; what the allocator does with its buffers is the same at either level.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "JAXMAMBA_CPU_HEAP": "1" if tuned else "0",
           "XLA_FLAGS": " ".join(flags)}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_large_buffers_stop_page_faulting_at_every_call():
    tuned, untuned = _faults(True), _faults(False)
    assert tuned["applied"] and not untuned["applied"]
    # The control: untuned, each call maps its buffers afresh. (With transparent huge pages on every mapping
    # the faults would be few and large; this machine's kernel faults 4 KiB pages in mmaps.)
    untuned_faults = statistics.median(untuned["faults"][20:])
    if untuned_faults < 4000:
        pytest.skip(f"untuned calls fault {untuned_faults:.0f} pages: this kernel maps them otherwise")
    # Tuned: once the heap has grown, the buffers come back from it; a few faults of other allocations at most.
    assert statistics.median(tuned["faults"][20:]) < 500, tuned["faults"]
    assert max(tuned["faults"][30:]) < 500, tuned["faults"]


def test_the_switch_leaves_the_allocator_alone(monkeypatch):
    from jaxmamba import cpu_heap

    monkeypatch.setattr(cpu_heap, "_state", {})
    monkeypatch.setenv("JAXMAMBA_CPU_HEAP", "0")
    assert cpu_heap.keep_large_buffers_on_heap() is False


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _fastbin_bytes_freeing_small_blocks() -> int:
    """Bytes that freeing 64 blocks of 40 bytes puts in glibc's fastbins (0 while they are off: past the thread's
    cache of 7, the blocks go back to the free lists)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = _MallInfo2
    blocks = [libc.malloc(40) for _ in range(64)]
    before = libc.mallinfo2().fsmblks
    for block in blocks:
        libc.free(block)
    return libc.mallinfo2().fsmblks - before


_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_fastbins_are_off_inside_the_scope_until_the_last_one_ends():
    from jaxmamba import cpu_heap

    assert _fastbin_bytes_freeing_small_blocks() > 0  # the control: on by default
    with cpu_heap.fastbins_off():
        assert _fastbin_bytes_freeing_small_blocks() == 0
        with cpu_heap.fastbins_off():  # another thread's restore overlapping this one
            assert _fastbin_bytes_freeing_small_blocks() == 0
        assert _fastbin_bytes_freeing_small_blocks() == 0
    assert _fastbin_bytes_freeing_small_blocks() > 0
    with pytest.raises(RuntimeError), cpu_heap.fastbins_off():
        raise RuntimeError("a failed restore")
    assert _fastbin_bytes_freeing_small_blocks() > 0


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_the_switch_leaves_fastbins_on_while_restoring(monkeypatch):
    from jaxmamba import cpu_heap

    monkeypatch.setenv("JAXMAMBA_CPU_HEAP", "0")
    with cpu_heap.fastbins_off():
        assert _fastbin_bytes_freeing_small_blocks() > 0


def test_the_default_fastbin_limit_honours_glibc_tunables(monkeypatch):
    from jaxmamba import cpu_heap

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert cpu_heap.default_fastbin_limit() == 16 * ctypes.sizeof(ctypes.c_size_t)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=32")
    assert cpu_heap.default_fastbin_limit() == 32


@pytest.mark.skipif(not _GLIBC, reason="glibc only")
def test_the_executable_cache_restores_with_fastbins_off(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable

    from jaxmamba.compile_cache import ExecutableCache, _entry_is_for, persistent_cache_reads

    cache = ExecutableCache(tmp_path)
    lowered = jax.jit(lambda x: jnp.sin(x) * 2.0).lower(jnp.ones(8))
    # Compiled, or returned by JAX's persistent cache (another test's): then stored from its entry's bytes.
    with persistent_cache_reads() as reads:
        compiled = lowered.compile()
    serialized = reads.serialized if _entry_is_for(reads, lowered) else None
    assert cache.store("k" * 64, compiled, extra={"n": 1}, serialized_executable=serialized), cache.rejected
    seen = []
    original = serialize_executable.deserialize_and_load

    def observed(*args, **kwargs):
        seen.append(_fastbin_bytes_freeing_small_blocks())
        return original(*args, **kwargs)

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", observed)
    executable, extra = cache.load("k" * 64)
    assert seen == [0] and extra == {"n": 1}
    assert float(executable(jnp.zeros(8))[0]) == 0.0
    assert _fastbin_bytes_freeing_small_blocks() > 0
