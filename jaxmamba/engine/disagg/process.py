"""The P and D engines in spawned processes, driven over a multiprocessing pipe (as
``transfer.pages.synthetic_prefill_main``): ``prefill_process_main``, ``decode_process_main`` and the driver
``EngineProcess``, which the tests and ``python -m jaxmamba.bench transfer --engine`` use."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from dataclasses import asdict
from typing import Callable

from jaxmamba import errors
from jaxmamba.engine.disagg.decode import DecodeEngine
from jaxmamba.engine.disagg.handoff import Handoff
from jaxmamba.engine.disagg.prefill import PrefillEngine
from jaxmamba.engine.llm import LLM
from jaxmamba.engine.request import SamplingParams
from jaxmamba.errors import SlotError, TransferError
from transfer.nixl_bridge import live_registrations


def _start_process(spec: dict) -> None:
    """Apply ``spec["env"]`` before JAX starts its backend (device count), and the compile cache."""
    os.environ.update(spec.get("env", {}))
    if spec.get("compile_cache"):
        import jax

        jax.config.update("jax_compilation_cache_dir", spec["compile_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _serve_commands(conn, handlers: dict[str, Callable], idle: Callable[[], None], idle_s: float) -> None:
    """Answer ``(name, *args)`` commands until ``("exit",)`` or a closed pipe; ``idle()`` every ``idle_s``."""
    while True:
        try:
            if not conn.poll(idle_s):
                idle()
                continue
            name, *args = conn.recv()
        except (EOFError, OSError):
            return
        if name == "exit":
            return
        try:
            reply = handlers[name](*args)
        except Exception as err:  # the driver re-raises it with its class name
            reply = ("error", type(err).__name__, str(err))
        conn.send(reply)


def _invariant_violation(llm: LLM) -> str:
    """``""`` when ``llm.check_invariants()`` passes, else its ``SlotError`` message (sent over the pipe)."""
    try:
        llm.check_invariants()
    except SlotError as err:
        return str(err)
    return ""


def prefill_process_main(conn, spec: dict) -> None:
    """Prefill engines in this (spawned) process, one per ``spec["engines"][key]``.

    ``spec``: ``env`` (applied first: ``XLA_FLAGS`` for the device count), ``compile_cache``,
    ``engines`` ``{key: {"model": path, "engine_id", "engine_args": LLM kwargs, "staging_requests"}}``.
    Sends ``("ready", {key: [directory bytes per rank]})``, then answers:
    ``("prefill", key, prompts)`` -> ``[handoff bytes]``; ``("poll",)`` -> ``{key: handoffs still
    staged}``; ``("release", key, handoff ids)`` -> the same, after freeing those; ``("state",)`` ->
    ``{key: engine slots and blocks in use, requests held, handoffs staged, invariants ("" or the
    error)}``; ``("unmap", key)`` -> ``"unmapped"`` (deregister and unmap the staging pages: later
    READs fail; for fault tests); ``("close",)`` -> ``("closed", live registrations)``;
    returns on ``("exit",)``. Unless ``spec["progress_thread"]``, the agents run without NIXL's
    progress thread (it spins a core, too much on a small machine): notifications and READs then
    progress from this loop, every millisecond while idle.
    """
    _start_process(spec)

    engines: dict[str, PrefillEngine] = {}
    try:
        for key, e in spec["engines"].items():
            llm = LLM(e["model"], **e.get("engine_args", {}))
            engines[key] = PrefillEngine(llm, engine_id=e["engine_id"], staging_requests=e.get("staging_requests"),
                                         progress_thread=spec.get("progress_thread", False))
        conn.send(("ready", {key: eng.directories() for key, eng in engines.items()}))

        def staged() -> dict[str, int]:
            for eng in engines.values():
                eng.poll()
            return {key: eng.num_staged for key, eng in engines.items()}

        def state() -> dict[str, dict]:
            out = {}
            for key, eng in engines.items():
                stats = eng.llm.stats
                out[key] = {"slots_in_use": stats.slots_in_use, "blocks_in_use": stats.blocks_in_use,
                            "held": len(eng.llm.scheduler.held), "staged": eng.num_staged,
                            "invariants": _invariant_violation(eng.llm)}
            return out

        def release(key: str, handoff_ids: list[str]) -> dict[str, int]:
            for handoff_id in handoff_ids:
                engines[key].release(handoff_id)
            return staged()

        def unmap(key: str) -> str:
            engines[key].close()
            engines[key].staging.unmap()
            del engines[key]
            return "unmapped"

        def close() -> tuple[str, int]:
            for key in list(engines):
                engines.pop(key).close()
            return ("closed", live_registrations())

        _serve_commands(conn, {
            "prefill": lambda key, prompts: [h.to_bytes() for h in engines[key].prefill(prompts)],
            "poll": staged, "state": state, "release": release, "unmap": unmap, "close": close,
        }, idle=lambda: [eng.poll() for eng in engines.values()], idle_s=0.001)
    finally:
        for eng in engines.values():
            with contextlib.suppress(TransferError):
                eng.close()


def decode_process_main(conn, spec: dict) -> None:
    """Decode engines in this (spawned) process, one per ``spec["engines"][key]``.

    ``spec`` as ``prefill_process_main``, engines ``{key: {"model", "name", "engine_args",
    "staging_requests", "timeout_s"}}``. Sends ``("ready", None)``, then answers:
    ``("connect", key, directories)`` -> None, or the error text (recorded: that engine's handoffs
    fall back); ``("generate", key, handoffs, sampling params dict[, timeout_s])`` -> a dict with
    ``outputs`` (token ids per request), ``logprobs``, ``errors``, ``transfers`` (``TransferRecord``
    dicts), ``abandoned`` (handoff ids to release on P), ``invariants`` ("" or the ``SlotError``),
    slots, blocks and staging pages still in use, and ``compiles_while_serving`` (XLA compilations
    during the call); ``("disconnect", key, engine id)`` and ``("registrations",)`` -> live
    registrations.
    """
    _start_process(spec)

    engines: dict[str, DecodeEngine] = {}
    try:
        for key, e in spec["engines"].items():
            llm = LLM(e["model"], **e.get("engine_args", {}))
            engines[key] = DecodeEngine(llm, name=e.get("name", f"decode-{key}"),
                                        staging_requests=e.get("staging_requests"), timeout_s=e.get("timeout_s", 10.0))
        conn.send(("ready", None))

        def connect(key: str, directories: list[bytes]) -> str | None:
            try:
                engines[key].connect(directories)
            except TransferError as err:
                return str(err)
            return None

        def generate(key: str, handoffs: list[bytes], params: dict, timeout_s: float | None = None) -> dict:
            eng = engines[key]
            if timeout_s is not None:
                eng.timeout_s = timeout_s
            first, compiles_before = len(eng.abandoned), eng.llm.stats.backend_compiles_since_warmup
            outs = eng.generate([Handoff.from_bytes(h) for h in handoffs], SamplingParams(**params))
            invariants = _invariant_violation(eng.llm)
            stats = eng.llm.stats
            return {
                "outputs": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[{int(t): float(p) for t, p in step.items()} for step in o.outputs[0].logprobs or []]
                             for o in outs],
                "errors": [o.error for o in outs],
                "transfers": [asdict(eng.transfers[o.request_id]) if o.request_id in eng.transfers else None
                              for o in outs],
                "abandoned": eng.abandoned[first:],
                "invariants": invariants,
                "slots_in_use": stats.slots_in_use, "blocks_in_use": stats.blocks_in_use,
                "staging_in_use": eng.staging.num_used_slots, "staging_quarantined": eng.staging.num_quarantined,
                # The counter is process-wide: count what this call compiled (other engines warm up too).
                "compiles_while_serving": stats.backend_compiles_since_warmup - compiles_before,
            }

        def disconnect(key: str, engine_id: str) -> int:
            engines[key].disconnect(engine_id)
            return live_registrations()

        _serve_commands(conn, {"connect": connect, "generate": generate, "disconnect": disconnect,
                               "registrations": live_registrations}, idle=lambda: None, idle_s=1.0)
    finally:
        for eng in engines.values():
            with contextlib.suppress(TransferError):
                eng.close()


class EngineProcess:
    """One engine process (``prefill_process_main`` or ``decode_process_main``), spawned, driven over a pipe.

    ``ready`` is its first message's payload; ``call(name, *args)`` sends one command and returns the
    answer, re-raising a failure inside the process as the ``jaxmamba.errors`` class it had (else
    ``RuntimeError``). A process that dies or stays silent past the timeout raises ``TransferError``.
    """

    def __init__(self, target: Callable, spec: dict, *, start_timeout_s: float = 600.0):
        ctx = mp.get_context("spawn")  # never fork a process that holds JAX or NIXL/UCX threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.name = target.__name__
        try:
            tag, self.ready = self._receive(start_timeout_s)
            if tag != "ready":
                raise TransferError(f"{self.name} answered {tag!r} instead of 'ready'")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _receive(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TransferError(f"{self.name} (pid {self.proc.pid}) did not answer within {timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise TransferError(f"{self.name} (pid {self.proc.pid}) exited (code {self.proc.exitcode})") from None
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
            cls = getattr(errors, reply[1], None)
            raise (cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError)(
                f"in {self.name}: {reply[2]}")
        return reply

    def call(self, *command, timeout_s: float = 600.0):
        self.conn.send(command)
        return self._receive(timeout_s)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(("exit",))
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
