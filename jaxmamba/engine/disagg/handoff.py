"""What P and D share: the layer names both use, and (from ``transfer.staging``, which has no JAX so that a
vLLM prefill or decode tier can use them too) the ``Handoff`` that travels from a prefill engine to a
decode engine and the host ``StagingPool`` both sides register with NIXL (see the package docstring)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jax

from jaxmamba.engine.llm import LLM
from jaxmamba.parallel import mesh_tp_size
from jaxmamba.parallel.distributed import ProcessesDisagree, ProcessGather
from transfer.staging import Handoff, StagingPool
from transfer.staging import close_agents as _close_agents  # noqa: F401 - prefill/decode import it here

__all__ = ["Handoff", "StagingPool", "layer_names", "agree", "local_ranks", "named_failures", "side_gather", "tp_size_of"]

_gathers = itertools.count()  # one ProcessGather name per multi-process P or D engine, in construction order


def layer_names(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(mamba layer names, attention layer names)`` as both engines name them in directories and pages."""
    return (tuple(f"layers.{i}.mixer" for i in cfg.mamba_layer_ids),
            tuple(f"layers.{i}.attn" for i in cfg.attention_layer_ids))


def tp_size_of(llm: LLM) -> int:
    """The engine's ``tensor_parallel_size``."""
    if llm.mesh is None:
        return 1
    return mesh_tp_size(llm.mesh)


def local_ranks(llm: LLM) -> tuple[int, ...]:
    """The TP ranks whose devices belong to this process: every rank, unless the mesh spans processes."""
    if llm.mesh is None:
        return (0,)
    me = jax.process_index()
    return tuple(r for r, d in enumerate(llm.mesh.devices.flat) if d.process_index == me)


def side_gather(llm: LLM, kind: str, timeout_s: float) -> ProcessGather | None:
    """How the processes of a P or D engine spanning several agree (``ProcessGather``); None in one process.
    Built in the same order on every process (the names are numbered)."""
    if len(local_ranks(llm)) == tp_size_of(llm):
        return None
    return ProcessGather(f"pd-{kind}{next(_gathers)}", timeout_s=llm.config.distributed_timeout_s + timeout_s)


def agree(gather: ProcessGather | None, who: str, subject: str, **mine: Any) -> list[dict]:
    """Every process's ``mine`` (JSON values), in process order; ``[mine]`` without ``gather`` (one process).

    ``ProcessesDisagree`` naming ``who`` when the processes are not at the same ``subject`` (another
    handoff, other pages, other prompts): they were given different work."""
    if gather is None:
        return [mine]
    values = [json.loads(v) for v in gather.gather(json.dumps({"subject": subject, **mine}).encode())]
    if len({v["subject"] for v in values}) > 1:
        raise ProcessesDisagree(f"{who}: its processes reached different points: "
                                + "; ".join(f"process {p}: {v['subject'][:200]}" for p, v in enumerate(values)))
    return values


def named_failures(failures: list[str | None]) -> str | None:
    """None when no process failed; else the one failure (one process), or each failing process's."""
    if len(failures) == 1:
        return failures[0]
    named = [f"process {p}: {f}" for p, f in enumerate(failures) if f is not None]
    return "; ".join(named) if named else None
