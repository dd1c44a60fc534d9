"""``jaxmamba.cpu_heap``: an XLA CPU program whose buffers pass glibc's 32 MiB mmap ceiling stops page-faulting
them afresh at every call once the engine has tuned the allocator (the full sampling tail ran 5-6x the greedy
one's time on the CPU for that reason alone)."""

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
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "JAXMAMBA_CPU_HEAP": "1" if tuned else "0"}
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
