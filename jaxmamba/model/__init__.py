"""The hybrid model: pure math in ``ops``, NNX modules in ``layers``, ``mlp``, ``moe`` and ``hybrid``."""

from jaxmamba.model.hybrid import HybridForCausalLM

__all__ = ["HybridForCausalLM"]
