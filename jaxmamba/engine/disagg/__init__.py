"""Engine-level P/D disaggregation: a prefill ``LLM`` and a decode ``LLM`` of any two TP sizes.

The prefill (P) engine computes a prompt's first ``N-1`` tokens. The decode (D) engine READs that
request's attention KV blocks and Mamba state (conv + SSM, the state after token ``N-1``) over NIXL,
then computes token ``N`` from it as a one-token extend with prior state, which the metadata
classifies as a decode (seed 000), and keeps decoding. The TP re-sharding lives entirely in the
READ byte ranges (``transfer.hetero_tp.TransferPlan``, one per D rank): nothing is permuted on
either side, and the bytes each D rank receives are exactly the pages its own sharding would hold.

Flow (``Handoff`` is what travels from P to D besides NIXL's own traffic)::

    P  PrefillEngine.prefill(prompts)
         LLM computes prompt[:N-1]; the request is held on finish (Scheduler.hold_on_finish)
         stage: copy its state slot and KV blocks, per P rank, into the registered staging pool
         release the engine's blocks/slots; Handoff(prompt, N-1, RequestPages of staging ids)
    D  DecodeEngine.add_request(handoff, params)
         every D rank: PageImporter.read_request into D's registered staging pool (plan ranges)
         all READs done: Scheduler.admit_computed(req, N-1), one AOT-compiled scatter copies the
         staged pages into the JAX caches, D staging freed; the next step decodes token N
    P  PrefillEngine.poll(): once every D rank that reads a P rank has notified it (NIXL
         notification "<request id>|<readers>"), the P staging pages are freed

Why host staging on the P side. The jitted step donates the caches: after every step they are new
``jax.Array``s, and XLA may give them new buffers (donation allows reuse, it does not promise
it). A NIXL registration of a live cache buffer is therefore valid only while the engine does not
step. The two correct options are (a) register the live caches after the prefill and keep the
engine idle until every reader is done (zero copy; but the P engine stalls for each transfer, and
registrations, remote keys and directories change every round, so D reconnects every round), or
(b) copy each request's pages into host arrays registered once at start-up. This module does (b):
the P engine keeps prefilling while D engines read, agents and directories are set up once, and
the copy is only the request's own pages (one state slot and ``cdiv(N-1, block_size)`` KV blocks
per layer and rank, read through zero-copy numpy views of the CPU device buffers; on a GPU the
view would be a device-to-host copy of the whole cache shard, and a device-side gather of the
request's pages the thing to add).
``Scheduler.hold_on_finish`` keeps the request's blocks and slot allocated from its finish until
the copy: nothing can reuse them in between, and while the staging pool is full (D has not read
yet) finished prefills simply stay held in the engine (backpressure, no loss).

Why staging on the D side. The D caches are donated JAX arrays too, so they cannot be READ
targets; READs land in host pages registered once per connected P engine, and only when every
D rank's READ has completed is the request admitted and the data installed into the caches. A
failed READ leaves nothing but staging pages to drop: no partially written state is ever used,
and admission after the READs means there are no engine blocks or slots to take back.

Faults (each recorded in ``DecodeEngine.transfers[request_id].error``; the request then computes
its whole prompt on the D engine, which gives the same tokens, and its handoff id lands in
``DecodeEngine.abandoned`` so the caller can ``PrefillEngine.release`` it on P):

* plan / page-size mismatch (another model, dtype, block size, speculative rows, or a TP pair
  without a rank mapping): ``connect`` raises ``TransferError`` and remembers why; handoffs from
  that engine fall back. A handoff whose pages do not fit this model falls back as well.
* dead peer, failed READ, READ timeout: ``ReadFailed`` from the bridge (which then drops that P
  rank: later handoffs from the engine fall back at once until ``connect`` is called again). The
  request's D staging pages are freed, or kept out of use for good if NIXL could not cancel a
  READ into them.

``prefill_process_main`` / ``decode_process_main`` run the two engines in spawned processes
(commands over a multiprocessing pipe, as ``transfer.pages.synthetic_prefill_main``) and
``EngineProcess`` drives them; the tests and ``python -m jaxmamba.bench transfer --engine`` use them.

Modules: ``handoff`` (``Handoff``, the ``StagingPool`` both sides register, layer names), ``prefill``
(``PrefillEngine``), ``decode`` (``DecodeEngine``, ``TransferRecord``), ``process`` (the engines in spawned
processes, ``EngineProcess``).
"""

from jaxmamba.engine.disagg.decode import DecodeEngine, TransferRecord
from jaxmamba.engine.disagg.handoff import Handoff, StagingPool, layer_names, tp_size_of
from jaxmamba.engine.disagg.prefill import PrefillEngine
from jaxmamba.engine.disagg.process import EngineProcess, decode_process_main, prefill_process_main

__all__ = [
    "DecodeEngine",
    "EngineProcess",
    "Handoff",
    "PrefillEngine",
    "StagingPool",
    "TransferRecord",
    "decode_process_main",
    "layer_names",
    "prefill_process_main",
    "tp_size_of",
]
