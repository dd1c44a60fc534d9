"""jaxmamba: vLLM's hybrid Mamba2 serving path in JAX/Pallas, with vLLM-compatible state layouts."""

from jaxmamba.config import HybridConfig
from jaxmamba.engine import LLM, RequestOutput, SamplingParams
from jaxmamba.errors import CheckpointError, ConfigError, MetadataError, RequestError, SlotError, TransferError
from jaxmamba.random_checkpoint import random_model
from jaxmamba.weights import load_hf, load_pretrained, restore_orbax, save_orbax

__all__ = [
    "HybridConfig",
    "LLM",
    "RequestOutput",
    "SamplingParams",
    "CheckpointError",
    "ConfigError",
    "MetadataError",
    "RequestError",
    "SlotError",
    "TransferError",
    "load_hf",
    "load_pretrained",
    "random_model",
    "restore_orbax",
    "save_orbax",
]
__version__ = "0.1.0"
