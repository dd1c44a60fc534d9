"""``python -m jaxmamba serve MODEL``: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the ``serve`` extra).

Routes: ``/v1/completions``, ``/v1/chat/completions`` (when the checkpoint's ``tokenizer_config.json`` has a
chat template), ``/v1/models``, ``/health`` and Prometheus ``/metrics`` (vLLM's metric names). Streaming
responses are server-sent events ending in ``data: [DONE]``. A client that disconnects, streaming or not,
aborts its request: its blocks and slots go back to the pools at once. Errors, unknown routes included, are
OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``).

Shutting down (``serve``): the first Ctrl-C (or SIGTERM) stops accepting connections and lets the requests
in flight finish; a second aborts them (a non-streaming client gets a 503 error object, a streaming one an
error event and ``data: [DONE]``); a third exits at once. The engine then checks that its pools are empty
and logs what it found.

Request fields follow vLLM's OpenAI server: OpenAI's (``max_tokens``, ``temperature``, ``top_p``, ``n``,
``stop``, ``seed``, ``logprobs``, ``stream``, ``stream_options``, penalties) plus vLLM's extras (``top_k``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``,
``include_stop_str_in_output``, ``skip_special_tokens``). What ``SamplingParams`` refuses is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the OpenAI server needs the serve extra: pip install 'jaxmamba[serve]'") from e

from jaxmamba.engine.async_engine import AsyncLLM, EngineShutdownError
from jaxmamba.engine.chat import load_chat_template, render_chat
from jaxmamba.engine.data_parallel import DataParallelAsyncLLM, check_one_process
from jaxmamba.engine.request import RequestOutputKind, SamplingParams
from jaxmamba.errors import ConfigError, RequestError
from jaxmamba.serve_metrics import Metrics

#: uvicorn's own logger, so the server's lines share its format.
logger = logging.getLogger("uvicorn.error")

#: OpenAI request fields -> SamplingParams fields (same name unless mapped).
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "max_tokens", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "include_stop_str_in_output", "skip_special_tokens")
#: Fields accepted and without effect on the tokens (as in vLLM's server).
_IGNORED_FIELDS = ("model", "user", "stream", "stream_options", "prompt", "messages", "logprobs", "top_logprobs",
                   "echo", "best_of", "suffix", "logit_bias", "add_generation_prompt", "max_completion_tokens")


class _BadRequest(Exception):
    pass


def _sampling_params(body: dict, *, chat: bool, stream: bool) -> SamplingParams:
    unknown = sorted(set(body) - set(_SAMPLING_FIELDS) - set(_IGNORED_FIELDS))
    if unknown:
        raise _BadRequest(f"unsupported request fields: {unknown}")
    for name, ok in (("echo", (None, False)), ("suffix", (None,)), ("logit_bias", (None, {}))):
        if body.get(name) not in ok:
            raise _BadRequest(f"{name} is not supported")
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise _BadRequest("best_of must equal n (beam search is not supported)")
    kwargs = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if chat and body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"] = body["max_completion_tokens"]
    if chat:
        kwargs.setdefault("max_tokens", None)  # as vLLM's chat: up to max_model_len (completions: 16)
    logprobs = body.get("logprobs")
    if chat:
        if logprobs:
            kwargs["logprobs"] = body.get("top_logprobs") or 0
    elif logprobs is not None:
        kwargs["logprobs"] = logprobs
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kwargs)
    except (RequestError, TypeError) as e:
        raise _BadRequest(str(e)) from None


def _completion_logprobs(completion, offset: int) -> dict | None:
    """OpenAI's legacy completions ``logprobs`` object for one choice's tokens."""
    if completion.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        lp = entry[token]
        tokens.append(lp.decoded_token or f"<{token}>")
        token_lps.append(float(lp))
        tops.append({(v.decoded_token or f"<{k}>"): float(v) for k, v in entry.items()})
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(completion) -> dict | None:
    if completion.logprobs is None:
        return None
    content = []
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        lp = entry[token]
        content.append({"token": lp.decoded_token or f"<{token}>", "logprob": float(lp), "bytes": None,
                        "top_logprobs": [{"token": v.decoded_token or f"<{k}>", "logprob": float(v), "bytes": None}
                                         for k, v in entry.items() if k != token or v.rank is not None]})
    return {"content": content}


class OpenAIServer:
    """The routes over one ``AsyncLLM`` (or a ``DataParallelAsyncLLM``: its replicas behind the same routes);
    ``app`` is the ASGI application."""

    def __init__(self, engine: AsyncLLM | DataParallelAsyncLLM, model_name: str, chat_template: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.created = int(time.time())
        self.metrics = Metrics(self)
        self.app = self._build_app()

    # ------------------------------------------------------------------ helpers
    def _error(self, message: str, status: int = 400, kind: str = "BadRequestError"):
        return JSONResponse(_error_body(message, status, kind), status_code=status)

    def _render_chat(self, messages) -> str:
        """The prompt of a chat request's ``messages`` (``RequestError`` naming a malformed message)."""
        return render_chat(self.chat_template, messages, add_generation_prompt=True)

    def _prompts(self, prompt) -> list:
        """OpenAI's ``prompt``: a string, a list of strings, a list of ids or a list of id lists."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return list(prompt)
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [prompt]
            if all(isinstance(p, list) for p in prompt):
                return list(prompt)
        raise _BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of those")

    async def _validate(self, prompts: list, params: SamplingParams) -> list[list[int]]:
        """Every prompt's token ids, each checked as the engine would check it (``RequestError`` if one is
        bad): all are validated before any runs."""
        one = SamplingParams(**_one(params))

        def check(core):
            ids = [core.prompt_token_ids(p) for p in prompts]
            for p in ids:
                core.new_request(p, one)
            return ids

        return await asyncio.wrap_future(self.engine.call_with_core(check))

    async def _run(self, raw_request, prompt, params: SamplingParams, request_id: str):
        """Yield a request's outputs; stops (which aborts the request) when the client disconnects."""
        start, first, last, generated = time.monotonic(), None, None, 0
        gen = self.engine.generate(prompt, params, request_id)
        it = gen.__aiter__()
        task = None
        try:
            while True:
                task = asyncio.ensure_future(it.__anext__())
                while not task.done():
                    await asyncio.wait({task}, timeout=0.25)
                    if not task.done() and await raw_request.is_disconnected():
                        return
                try:
                    out = task.result()
                except StopAsyncIteration:
                    return
                new = sum(len(c.token_ids) for c in out.outputs)
                now = time.monotonic()
                if new and first is None:
                    first = now
                    self.metrics.ttft.observe(first - start)
                elif new and last is not None:
                    self.metrics.itl.observe((now - last) / new)
                if new:
                    last, generated = now, generated + new
                if out.finished:
                    self.metrics.e2e.observe(now - start)
                    self.metrics.prompt_len.observe(len(out.prompt_token_ids))
                    self.metrics.output_len.observe(sum(len(c.token_ids) for c in out.outputs)
                                                    if params.output_kind is not RequestOutputKind.DELTA else generated)
                    for c in out.outputs:
                        self.metrics.finished(c.finish_reason)
                yield out
        finally:
            # A pending __anext__ must end (its cancellation aborts the request) before the generator can be
            # closed: closing it while it runs is "aclose(): asynchronous generator is already running".
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()

    # ------------------------------------------------------------------ routes
    def _build_app(self):
        app = FastAPI(title="jaxmamba OpenAI-compatible server")

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created, "owned_by": "jaxmamba",
                "root": self.model_name, "max_model_len": self.engine.engine_core.max_model_len}]}

        app.post("/v1/completions", name="completions")(self._completions)
        app.post("/v1/chat/completions", name="chat")(self._chat)
        self._add_error_handlers(app)
        return app

    async def _body_of(self, raw: Request) -> dict:
        """The request's JSON object (``_BadRequest`` if it is none; ``_NotFound`` for another model's name)."""
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("the request body must be a JSON object")
        if body.get("model", self.model_name) != self.model_name:
            raise _NotFound(f"The model `{body.get('model')}` does not exist.")
        return body

    async def _completions(self, raw: Request):
        """``POST /v1/completions``."""
        try:
            body = await self._body_of(raw)
            stream = bool(body.get("stream", False))
            params = _sampling_params(body, chat=False, stream=stream)
            prompts = self._prompts(body.get("prompt"))
        except _NotFound as e:
            return self._error(str(e), 404, "NotFoundError")
        except _BadRequest as e:
            return self._error(str(e))
        rid = f"cmpl-{uuid.uuid4().hex}"
        # Validate every prompt before running any (a bad one is a 400, nothing queued).
        try:
            ids = await self._validate(prompts, params)
        except RequestError as e:
            return self._error(str(e))
        n = params.n
        if stream:
            return StreamingResponse(self._error_events(self._stream_completions(raw, rid, ids, params, body)),
                                     media_type="text/event-stream")
        outs = await self._gather(raw, rid, ids, params)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(outs):
            if out.error and not any(c.token_ids for c in out.outputs):
                return self._error(out.error, 500, "InternalServerError")
            for c in out.outputs:
                choices.append({"index": i * n + c.index, "text": c.text or "", "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason, "logprobs": _completion_logprobs(c, 0)})
        return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": _usage(sum(len(p) for p in ids), outs)})

    async def _chat(self, raw: Request):
        """``POST /v1/chat/completions``."""
        if self.chat_template is None:
            return self._error("this model has no chat template (tokenizer_config.json 'chat_template'); "
                               "use /v1/completions", 400)
        try:
            body = await self._body_of(raw)
            stream = bool(body.get("stream", False))
            params = _sampling_params(body, chat=True, stream=stream)
            prompt = self._render_chat(body.get("messages"))
            ids = await self._validate([prompt], params)
        except _NotFound as e:
            return self._error(str(e), 404, "NotFoundError")
        except (_BadRequest, RequestError) as e:
            return self._error(str(e))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if stream:
            return StreamingResponse(self._error_events(self._stream_chat(raw, rid, ids[0], params, body)),
                                     media_type="text/event-stream")
        outs = await self._gather(raw, rid, ids, params)
        if outs is None:
            return Response(status_code=499)
        out = outs[0]
        if out.error and not any(c.token_ids for c in out.outputs):
            return self._error(out.error, 500, "InternalServerError")
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "logprobs": _chat_logprobs(c)} for c in out.outputs]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices, "usage": _usage(len(ids[0]), outs)})

    def _add_error_handlers(self, app) -> None:
        """Every error as OpenAI's error object, whatever raised it."""
        @app.exception_handler(Exception)
        async def internal(request, exc):  # pragma: no cover - a bug, reported as OpenAI's error shape
            return self._error(f"{type(exc).__name__}: {exc}", 500, "InternalServerError")

        @app.exception_handler(EngineShutdownError)
        async def shutting_down(request, exc):  # the second Ctrl-C aborted this request, or it came too late
            return self._error(str(exc), 503, "ServiceUnavailableError")

        @app.exception_handler(HTTPException)
        async def http_error(request, exc):  # an unknown route (404), a wrong method (405): OpenAI's shape too
            kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "HTTPError")
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return self._error(message, exc.status_code, kind)

        @app.exception_handler(RequestValidationError)
        async def invalid(request, exc):
            return self._error(str(exc), 400)

    async def _gather(self, raw, rid: str, ids: list[list[int]], params: SamplingParams):
        """Run every prompt to its final output; None if the client went away (all aborted)."""
        async def one(i, p):
            last = None
            async for out in self._run(raw, p, params, f"{rid}-{i}"):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(ids)]
        try:
            outs = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return None if any(o is None or not o.finished for o in outs) else outs

    async def _error_events(self, events):
        """A stream's events, ending in an error event and ``[DONE]`` if the engine shuts down under it."""
        try:
            async for event in events:
                yield event
        except EngineShutdownError as e:
            yield f"data: {json.dumps(_error_body(str(e), 503, 'ServiceUnavailableError'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    async def _stream_completions(self, raw, rid: str, ids, params: SamplingParams, body: dict):
        created, n = int(time.time()), params.n
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        queue: asyncio.Queue = asyncio.Queue()
        offsets: dict[int, int] = {}

        async def pump(i, p):  # ends with (i, None), or (i, the exception) for the consumer to raise
            try:
                async for out in self._run(raw, p, params, f"{rid}-{i}"):
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
            else:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(ids)]
        completion_tokens, open_prompts = 0, len(ids)
        try:
            while open_prompts:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out is None:
                    open_prompts -= 1
                    continue
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    index = i * n + c.index
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [{"index": index, "text": c.text or "", "finish_reason": c.finish_reason,
                                          "stop_reason": c.stop_reason,
                                          "logprobs": _completion_logprobs(c, offsets.get(index, 0))}]}
                    offsets[index] = offsets.get(index, 0) + len(c.text or "")
                    yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                prompt_tokens = sum(len(p) for p in ids)
                yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                             "model": self.model_name, "choices": [], "usage": {
                                                 "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                                 "total_tokens": prompt_tokens + completion_tokens}}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream_chat(self, raw, rid: str, ids: list[int], params: SamplingParams, body: dict):
        created = int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        for i in range(params.n):
            yield "data: " + json.dumps({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                              "finish_reason": None, "logprobs": None}]}) + "\n\n"
        completion_tokens = 0
        async for out in self._run(raw, ids, params, rid):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                yield "data: " + json.dumps({**base, "choices": [{
                    "index": c.index, "delta": {"content": c.text or ""}, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "logprobs": _chat_logprobs(c)}]}) + "\n\n"
        if include_usage:
            yield "data: " + json.dumps({**base, "choices": [], "usage": {
                "prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens}}) + "\n\n"
        yield "data: [DONE]\n\n"


class _NotFound(Exception):
    pass


def _usage(prompt_tokens: int, outs) -> dict:
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _one(params: SamplingParams) -> dict[str, Any]:
    """``params`` as keyword arguments of one sample (for validating a prompt without queueing it)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} | {"n": 1, "seed": params.seed}


def _error_body(message: str, status: int, kind: str) -> dict:
    """OpenAI's error object. The message may quote the request's own text: what cannot be sent as UTF-8
    (a lone surrogate) is escaped, or the error response itself would fail."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def served_name(model, checkpoint: Path | None) -> str:
    """The model id the API shows: the checkpoint directory's name (``/data/ckpts/tiny/`` -> ``tiny``)."""
    path = Path(model) if isinstance(model, (str, Path)) else checkpoint
    return path.resolve().name if path is not None else "jaxmamba"


def build_server(model, *, served_model_name: str | None = None, data_parallel_size: int = 1,
                 **engine_args) -> OpenAIServer:
    """An ``OpenAIServer`` over ``model`` (a checkpoint directory, or an ``LLM``/``LLMEngine``/``AsyncLLM``/
    ``DataParallelAsyncLLM``). Its model id is ``served_model_name``, else the checkpoint directory's name.
    ``data_parallel_size`` > 1: that many engine replicas behind the routes (``engine.data_parallel``)."""
    if isinstance(model, (AsyncLLM, DataParallelAsyncLLM)):
        engine = model
    elif data_parallel_size != 1:
        engine = DataParallelAsyncLLM(model, data_parallel_size=data_parallel_size, **engine_args)
    else:
        engine = AsyncLLM(model, **engine_args)
    checkpoint = engine.engine_core.checkpoint
    name = served_model_name or served_name(model, checkpoint)
    return OpenAIServer(engine, name, load_chat_template(checkpoint))


def check_port(port) -> int:
    """``port`` as a TCP port number (``ConfigError`` outside [0, 65535]; 0 lets the system pick one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port={port!r} must be an int in [0, 65535]")
    return port


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``ConfigError`` if that address cannot be had): bound before the
    engine compiles, so a busy or bad address fails at once rather than after start-up."""
    check_port(port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"host={host!r} cannot be resolved: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def serve(model, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info", data_parallel_size: int = 1, **engine_args) -> None:
    """Serve ``model`` until interrupted (see the module's docstring for how Ctrl-C shuts it down).

    A multi-process engine (``num_processes`` > 1): process 0 serves HTTP and schedules; every other process
    builds the same engine and replays process 0's steps (``engine.multiprocess.follow``) until it shuts down.
    """
    check_one_process(data_parallel_size, engine_args.get("num_processes"))
    if engine_args.get("process_id"):
        from jaxmamba.engine.llm_engine import LLMEngine
        from jaxmamba.engine.multiprocess import follow

        core = LLMEngine(model, **engine_args).engine_core
        pid = engine_args["process_id"]
        print(f"process {pid}: following process 0's steps (it serves HTTP)", file=sys.stderr, flush=True)
        steps = follow(core)
        print(f"process {pid}: process 0 stopped after {steps} steps", file=sys.stderr, flush=True)
        return
    sock = bind_socket(host, port)
    try:
        server = build_server(model, served_model_name=served_model_name, data_parallel_size=data_parallel_size,
                              **engine_args)
    except BaseException:
        sock.close()
        raise
    uv = _Server(uvicorn.Config(server.app, log_level=log_level), server.engine)
    try:
        uv.run(sockets=[sock])
    finally:
        sock.close()
        server.engine.shutdown()
        _log_pools(server.engine)


def _log_pools(engine: AsyncLLM | DataParallelAsyncLLM) -> None:
    """After the engine threads stopped: every engine's pools must be empty and its invariants hold."""
    replicas = getattr(engine, "replicas", [engine])
    for i, replica in enumerate(replicas):
        core = replica.engine_core
        core.check_invariants()
        s = core.stats
        which = f"engine {i}" if len(replicas) > 1 else "engine"
        if s.blocks_in_use or s.slots_in_use:
            logger.error("%s stopped with %d KV blocks and %d state slots still in use", which, s.blocks_in_use,
                         s.slots_in_use)
        else:
            logger.info("%s stopped: pools empty (0 KV blocks, 0 state slots in use), %d requests unfinished",
                        which, len(core.scheduler.running) + len(core.scheduler.waiting))


class _Server(uvicorn.Server):
    """uvicorn's server with the shutdown of this module's docstring. Signals are not re-raised after it
    stops (uvicorn's default), which turned a Ctrl-C into a ``KeyboardInterrupt`` traceback."""

    def __init__(self, config, engine: AsyncLLM | DataParallelAsyncLLM):
        super().__init__(config)
        self.engine = engine
        self.interrupts = 0
        self.loop = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        host, port = sockets[0].getsockname()[:2] if sockets else (self.config.host, self.config.port)
        logger.info("serving on http://%s:%d (Ctrl-C to stop)", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig, frame):
        # A signal handler: it only sets flags and hands the rest to the event loop.
        self.interrupts += 1
        if self.interrupts == 1:
            self.should_exit = True
            self._later(logger.info, "shutting down: requests in flight finish first (Ctrl-C again to abort them)")
        elif self.interrupts == 2:
            self._later(logger.info, "aborting the requests in flight (Ctrl-C again to exit at once)")
            self._later(self.engine.abort_all, "the server is shutting down")
        else:
            self.force_exit = True

    def _later(self, fn, *args):
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)
