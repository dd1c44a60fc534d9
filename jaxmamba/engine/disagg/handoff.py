"""What P and D share: the layer names both use, and (from ``transfer.staging``, which has no JAX so that a
vLLM prefill or decode tier can use them too) the ``Handoff`` that travels from a prefill engine to a
decode engine and the host ``StagingPool`` both sides register with NIXL (see the package docstring)."""

from __future__ import annotations

from jaxmamba.engine.llm import LLM
from jaxmamba.parallel import mesh_tp_size
from transfer.staging import Handoff, StagingPool
from transfer.staging import close_agents as _close_agents  # noqa: F401 - prefill/decode import it here

__all__ = ["Handoff", "StagingPool", "layer_names", "tp_size_of"]


def layer_names(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(mamba layer names, attention layer names)`` as both engines name them in directories and pages."""
    return (tuple(f"layers.{i}.mixer" for i in cfg.mamba_layer_ids),
            tuple(f"layers.{i}.attn" for i in cfg.attention_layer_ids))


def tp_size_of(llm: LLM) -> int:
    """The engine's ``tensor_parallel_size``."""
    if llm.mesh is None:
        return 1
    return mesh_tp_size(llm.mesh)
