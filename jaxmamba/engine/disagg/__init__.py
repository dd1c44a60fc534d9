"""Engine-level P/D disaggregation: a prefill ``LLM`` and a decode ``LLM`` of any two TP sizes.

``PrefillEngine`` computes a prompt's first ``N-1`` tokens and stages its pages; ``DecodeEngine`` READs
them over NIXL and decodes from token ``N``; a fault falls back to computing the prompt on the decode
engine. Modules: ``handoff`` (``Handoff``, the ``StagingPool`` both sides register), ``prefill``,
``decode``, ``process`` (the engines in spawned processes, ``EngineProcess``), ``remote`` (P and D on
different hosts, over a network control channel: ``PrefillServer``, ``RemoteDisaggregation``). The flow, why both sides
stage and the faults: docs/architecture.md, "P/D disaggregation: the engines".
"""

from jaxmamba.engine.disagg.decode import DecodeEngine, TransferRecord
from jaxmamba.engine.disagg.handoff import Handoff, StagingPool, layer_names, tp_size_of
from jaxmamba.engine.disagg.prefill import PrefillEngine
from jaxmamba.engine.disagg.process import EngineProcess, decode_process_main, prefill_process_main
from jaxmamba.engine.disagg.remote import PrefillServer, RemoteDisaggregation, RemotePrefill, follow_prefill_server

__all__ = [
    "DecodeEngine",
    "EngineProcess",
    "Handoff",
    "PrefillEngine",
    "PrefillServer",
    "RemoteDisaggregation",
    "RemotePrefill",
    "StagingPool",
    "TransferRecord",
    "decode_process_main",
    "follow_prefill_server",
    "layer_names",
    "prefill_process_main",
    "tp_size_of",
]
