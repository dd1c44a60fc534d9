"""jaxmamba: vLLM's hybrid Mamba2 serving path in JAX/Pallas, with vLLM-compatible state layouts.

Top-level names load on first use, so ``import jaxmamba.errors`` or ``jaxmamba.config`` (used by
spawned transfer processes and tools) does not pay for importing JAX, flax and the engine.
"""

from __future__ import annotations

import importlib

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
