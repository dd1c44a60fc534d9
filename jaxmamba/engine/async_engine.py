"""``AsyncLLM``: the engine behind an asyncio API, one async generator of ``RequestOutput``s per request.

Steps are blocking device calls, so one background thread owns the ``LLMEngine``: it alone touches the
engine. Event loops (and other threads) hand it work through an inbox (``call``) and get the result as a
future, which the thread settles between two steps, so a caller never waits for the engine lock behind a
busy step loop. ``generate(prompt, params, request_id)`` yields the request's outputs (as its
``output_kind`` says) and ends with the finished one; a consumer that stops early (``break``, a cancelled
task, a client that hung up) aborts the request, and its blocks and slots return to the pools.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from jaxmamba.engine.gc_heap import frozen_heap
from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.multiprocess import lead_if_spanning
from jaxmamba.engine.request import RequestOutput, SamplingParams
from jaxmamba.errors import RequestError
from jaxmamba.parallel.distributed import DistributedError

logger = logging.getLogger(__name__)


class EngineShutdownError(RuntimeError):
    """The engine is shutting down: a request in flight was aborted, or a new one arrived too late."""


class AsyncLLM:
    """``AsyncLLM(model, **engine_args)`` (``LLM``'s arguments, or an ``LLM`` / ``LLMEngine`` / ``EngineCore`` to
    drive: the same core)."""

    def __init__(self, model, **engine_args):
        self.engine = model if isinstance(model, LLMEngine) else LLMEngine(model, **engine_args)
        # An engine over several processes' devices: this one (process 0) leads, the others follow its steps.
        self._leader = lead_if_spanning(self.engine.engine_core)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._refusing: str | None = None  # set by abort_all: why new requests are refused
        self._thread = threading.Thread(target=self._run, name="jaxmamba-engine", daemon=True)
        self._thread.start()

    @property
    def engine_core(self):
        """The ``EngineCore`` under the ``LLMEngine`` (touch it only on the engine thread, through ``call``)."""
        return self.engine.engine_core

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ the engine thread
    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps; its result (or exception) in a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped:
            future.set_exception(EngineShutdownError("the engine is shut down"))
            return future
        self._inbox.put((fn, future))
        self._wake.set()
        return future

    def call_with_core(self, fn: Callable) -> concurrent.futures.Future:
        """``fn(engine_core)`` on the engine thread (``call``): for questions about the core that owns it."""
        return self.call(lambda: fn(self.engine_core))

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)

    def _run(self) -> None:
        with frozen_heap():  # the start-up heap out of the loop's full collections (engine.gc_heap)
            self._serve()
        self._drain_inbox()

    def _serve(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a scheduling fault: fail every stream rather than hang them
                logger.exception("engine step failed")
                outputs = []
                for rid in list(self._streams):
                    self.engine.abort_request(rid)
                    self._deliver(rid, exc)
                if isinstance(exc, DistributedError):  # the processes are out of step: no further step can run
                    self._refusing = f"the multi-process engine stopped: {exc}"
            for out in outputs:
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its ``RequestOutput``s until it finishes (``RequestError`` if it is bad)."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add():
            if self._refusing is not None:
                raise EngineShutdownError(self._refusing)
            if request_id in self._streams:
                raise RequestError(f"request_id={request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, sampling_params)
            self._streams[request_id] = (loop, stream)

        await asyncio.wrap_future(self.call(add))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread ended it already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request (its stream, if one is open, ends without a final output)."""
        def abort():
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        return self.call(abort)

    def abort_all(self, reason: str) -> concurrent.futures.Future:
        """Abort every request and refuse new ones from now on: each open stream ends by raising
        ``EngineShutdownError(reason)`` (a server's shutdown)."""
        def abort_all():
            self._refusing = reason
            for rid in list(self._streams):
                self.engine.abort_request(rid)
                self._deliver(rid, EngineShutdownError(reason))

        return self.call(abort_all)

    def _query(self, fn: Callable, timeout: float = 60.0):
        return self.call(fn).result(timeout)

    def num_unfinished_requests(self) -> int:
        return self._query(self.engine.get_num_unfinished_requests)

    def stats(self):
        return self._query(lambda: self.engine_core.stats)

    def check_invariants(self) -> None:
        self._query(self.engine_core.check_invariants)

    def shutdown(self) -> None:
        """Abort what is left (``abort_all``), then stop the engine thread."""
        if not self._stopped and self._thread.is_alive():
            try:
                self.abort_all("the engine is shut down").result(30)
            except concurrent.futures.TimeoutError:
                logger.error("the engine thread did not abort its requests within 30 s")
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        if self._leader is not None and not self._thread.is_alive():
            self._leader.stop()  # the followers' follow() returns
            self._leader = None
