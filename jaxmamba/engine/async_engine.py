"""``AsyncLLM``: the engine behind an asyncio API, one async generator of ``RequestOutput``s per request.

Steps are blocking device calls, so one background thread drives the ``LLMEngine``; the event loop only
queues requests and receives outputs. ``generate(prompt, params, request_id)`` yields the request's outputs
(as its ``output_kind`` says) and ends with the finished one; a consumer that stops early (``break``, a
cancelled task, a client that hung up) aborts the request, and its blocks and slots return to the pools.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import AsyncIterator

from jaxmamba.engine.llm_engine import LLMEngine
from jaxmamba.engine.request import RequestOutput, SamplingParams
from jaxmamba.errors import RequestError

logger = logging.getLogger(__name__)


class AsyncLLM:
    """``AsyncLLM(model, **engine_args)`` (``LLM``'s arguments, or an ``LLM`` / ``LLMEngine`` to drive)."""

    def __init__(self, model, **engine_args):
        self.engine = model if isinstance(model, LLMEngine) else LLMEngine(model, **engine_args)
        self._lock = threading.Lock()  # guards the engine: requests come from the loop, steps from the thread
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxmamba-engine", daemon=True)
        self._thread.start()

    @property
    def llm(self):
        return self.engine.llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._wake.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a scheduling fault: fail every stream rather than hang them
                    logger.exception("engine step failed")
                    outputs = []
                    for rid in list(self._streams):
                        self.engine.abort_request(rid)
                        self._deliver(rid, exc)
            for out in outputs:
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its ``RequestOutput``s until it finishes (``RequestError`` if it is bad)."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            if request_id in self._streams:
                raise RequestError(f"request_id={request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, sampling_params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream, if one is open, ends without a final output)."""
        with self._wake:
            self.engine.abort_request(request_id)
            self._streams.pop(request_id, None)

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return self.engine.get_num_unfinished_requests()

    def stats(self):
        with self._lock:
            return self.llm.stats

    def check_invariants(self) -> None:
        with self._lock:
            self.llm.check_invariants()

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
