"""jaxmamba: vLLM's hybrid Mamba2 serving path in JAX/Pallas, with vLLM-compatible state layouts.

Top-level names load on first use, so ``import jaxmamba.errors`` or ``jaxmamba.config`` (used by
spawned transfer processes and tools) does not pay for importing JAX, flax and the engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os


def _default_to_cpu_without_a_gpu() -> None:
    """With the ``aot`` extra (jax's CUDA plugin) on a machine that has no NVIDIA driver, jax would print
    a plugin traceback at start and then drop the plugin, which compile-only GPU targets need: keep jax on
    the CPU instead (only when ``JAX_PLATFORMS`` is unset and jax is not imported yet)."""
    import sys

    if "JAX_PLATFORMS" in os.environ or "jax" in sys.modules or os.path.exists("/proc/driver/nvidia/version"):
        return
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        os.environ["JAX_PLATFORMS"] = "cpu"


_default_to_cpu_without_a_gpu()

from jaxmamba import cpu_heap

if cpu_heap.runs_on_the_cpu():
    cpu_heap.keep_large_buffers_on_heap()  # before JAX's CPU client starts its threads (see the module)

from jaxmamba.config import HybridConfig
from jaxmamba.errors import CheckpointError, ConfigError, MetadataError, RequestError, SlotError, TransferError

_LAZY = {
    "LLM": "jaxmamba.engine",
    "LLMEngine": "jaxmamba.engine",
    "AsyncLLM": "jaxmamba.engine.async_engine",
    "Logprob": "jaxmamba.engine",
    "RequestOutputKind": "jaxmamba.engine",
    "RequestOutput": "jaxmamba.engine",
    "SamplingParams": "jaxmamba.engine",
    "load_hf": "jaxmamba.weights",
    "load_pretrained": "jaxmamba.weights",
    "restore_orbax": "jaxmamba.weights",
    "save_orbax": "jaxmamba.weights",
    "random_model": "jaxmamba.random_checkpoint",
}
_SUBMODULES = ("cache", "compare", "engine", "layout", "metadata", "model", "sampling", "steps", "weights")

__all__ = [
    "HybridConfig",
    "CheckpointError",
    "ConfigError",
    "MetadataError",
    "RequestError",
    "SlotError",
    "TransferError",
    *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"jaxmamba.{name}")
    else:
        raise AttributeError(f"module 'jaxmamba' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
