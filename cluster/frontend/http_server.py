"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), served beside gRPC from the same
`Backend`: /v1/models, /v1/completions, /v1/chat/completions (SSE streams), /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from halfmoon.cluster.frontend.auth import UNAUTHENTICATED_MESSAGE, bearer_matches
from halfmoon.cluster.frontend.drain import Drain
from halfmoon.cluster.frontend.http_errors import error_body, http_error
from halfmoon.cluster.frontend.http_limits import HttpLimits
from halfmoon.cluster.frontend.http_protocol import uvicorn_config
from halfmoon.cluster.frontend.openai_responses import CHAT, COMPLETION, ResponseShape
from halfmoon.cluster.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from halfmoon.cluster.frontend.request_limits import (
    RequestLimits,
    check_prompt,
    check_request_id,
    check_stops,
)
from halfmoon.cluster.serving.backend import (
    Backend,
    GenerateInput,
    ModelInfo,
    ModelNotFoundError,
    TokenDelta,
    UnauthenticatedError,
)
from halfmoon.engine.errors import HalfmoonError, InvalidRequestError

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_GONE_STATUS = 499  # nginx's "client closed request"; nobody reads it
END = object()
BODY_OVERHEAD_BYTES = 1 << 20  # JSON fields around the prompt: sampling options, stops, ids


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


class Relay:
    """Runs one request's backend stream in a task of its own, so a client that goes away
    cancels it exactly once and the backend's clean-up (abort on every worker) runs to the end."""

    def __init__(self, backend: Backend, request: GenerateInput, drain: Drain) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(backend.generate(request), drain))

    async def _pump(self, deltas: AsyncIterator[TokenDelta], drain: Drain) -> None:
        try:
            with drain.track():  # a drain for shutdown waits for this stream
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        self.queue.put_nowait(delta)
        except Exception as error:  # noqa: BLE001 - handed to the reader, who maps it
            self.queue.put_nowait(error)
        finally:
            self.queue.put_nowait(END)

    async def next(self) -> TokenDelta | None:
        """The next delta; None at the end; the backend's error is raised here."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is END else item

    async def collect(self) -> list[TokenDelta]:
        deltas = []
        while (delta := await self.next()) is not None:
            deltas.append(delta)
        return deltas

    def cancel(self) -> None:
        self.task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events; closes its generator however the response ends (a disconnect
    cancels the sending task while the generator waits at a `yield`)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class OpenAIServer:
    """The routes of the OpenAI API over one backend; `app` is the ASGI application."""

    def __init__(
        self,
        backend: Backend,
        tokenizer,
        model: ModelInfo,
        registry: CollectorRegistry | None = None,
        api_key: str | None = None,
        limits: RequestLimits | None = None,
        drain: Drain | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()
        self.drain = drain or Drain()
        self.tokenizer = tokenizer
        self.model = model
        self.registry = registry
        self.api_key = api_key
        self.created = int(time.time())
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="halfmoon OpenAI-compatible API", docs_url=None, redoc_url=None)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_exception_handler(HTTPException, _http_exception)
        return app

    async def models(self, request: Request) -> Response:
        return await self._answer(request, self._models)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._generate(request, rid, COMPLETION))

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._generate(request, rid, CHAT))

    async def health(self) -> Response:
        ok, reason = await self.backend.health()
        if self.drain.draining:
            ok, reason = False, "shutting down"
        body = {"status": "ok" if ok else "unavailable", "reason": reason}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        if self.registry is None:
            return JSONResponse(error_body("no metrics here", "invalid_request_error"), 404)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _answer(self, request: Request, handler) -> Response:
        """Authorize, give the request its id, run `handler(id)`, map any error; the id goes
        back in X-Request-Id."""
        request_id = uuid.uuid4().hex
        try:
            self._authorize(request)  # first: nothing of an unauthenticated call is judged
            request_id = _request_id(request, self.limits) or request_id
            response = await handler(request_id)
        except ClientGone:
            response = Response(status_code=CLIENT_GONE_STATUS)
        except Exception as error:  # noqa: BLE001 - every error gets a status, internals hidden
            status, body = http_error(error)
            response = JSONResponse(body, status_code=status)
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    def _authorize(self, request: Request) -> None:
        if self.api_key and not bearer_matches(request.headers.get("authorization"), self.api_key):
            raise UnauthenticatedError(UNAUTHENTICATED_MESSAGE)

    async def _models(self, request_id: str) -> Response:
        card = {
            "id": self.model.model,
            "object": "model",
            "created": self.created,
            "owned_by": "halfmoon",
            "max_model_len": self.model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def _generate(self, request: Request, request_id: str, kind: str) -> Response:
        schema = ChatCompletionRequest if kind == CHAT else CompletionRequest
        self.drain.check_open()
        raw = await _read_body(request, self.limits.max_prompt_bytes + BODY_OVERHEAD_BYTES)
        body = _parse(schema, raw)
        self._check_model(body.model)
        generate_input = body.to_input(request_id, body.to_prompt(), self.model.max_model_len)
        params = generate_input.params
        check_prompt(generate_input.prompt, self.limits)
        check_stops(params.stop, len(params.stop_token_ids), self.limits)
        shape = ResponseShape(kind, request_id, self.model.model, self.tokenizer)
        relay = Relay(self.backend, generate_input, self.drain)
        if not body.stream:
            deltas = await _unless_client_gone(request, relay, relay.collect())
            return JSONResponse(shape.response(deltas))
        # The first delta before the headers: an error up to here gets its own HTTP status.
        first = await _unless_client_gone(request, relay, relay.next())
        shape.include_usage = body.include_usage
        return EventStream(_events(relay, first, shape))

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.model:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; this server serves {self.model.model!r} "
                "(see GET /v1/models)"
            )


async def _events(relay: Relay, delta: TokenDelta | None, shape: ResponseShape):
    """The SSE body: one `data:` line per chunk, an error object if the stream fails, [DONE]."""
    try:
        usage = None
        if (opening := shape.first_chunk()) is not None:
            yield _event(opening)
        while delta is not None:
            if (chunk := shape.chunk(delta)) is not None:
                yield _event(chunk)
            usage = delta.usage or usage
            delta = await relay.next()
        if shape.include_usage and usage is not None:
            yield _event(shape.usage_chunk(usage))
    except Exception as error:  # noqa: BLE001 - the status is sent; the error goes in-stream
        yield _event(http_error(error)[1])
    finally:
        relay.cancel()  # a no-op once the stream ended; else the request is aborted
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused once it is known to exceed `max_bytes`: by its Content-Length before
    any of it is read, else (chunked) as soon as the bytes read so far exceed it."""
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > max_bytes:
        raise _body_too_large(f"<{declared} bytes>", max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _body_too_large(f"<more than {max_bytes} bytes>", max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def _body_too_large(value: str, max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(
        "body",
        value,
        f"at most {max_bytes} bytes allowed (limits.max_prompt_bytes plus room for the other "
        "fields)",
    )


async def _unless_client_gone(request: Request, relay: Relay, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel the request and raise ClientGone."""
    work_task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work_task.done():
        work_task.cancel()
        relay.cancel()
        raise ClientGone
    return work_task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _request_id(request: Request, limits: RequestLimits) -> str | None:
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        return None
    check_request_id(request_id, limits, REQUEST_ID_HEADER)
    if not request_id or not request_id.isprintable():
        raise InvalidRequestError(
            REQUEST_ID_HEADER, request_id[:32], "must be printable characters, at least one"
        )
    return request_id


def _parse(schema: type[OpenAIRequest], body: bytes) -> OpenAIRequest:
    """The request body as `schema`; the first problem as an `InvalidRequestError`."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequestError):
            raise cause from None
        where = ".".join(str(part) for part in error["loc"]) or "body"
        value = error["input"] if error["type"] != "missing" else None
        message = error["msg"]
        if error["type"] == "json_invalid":
            value = "<not JSON>"
            if "hex escape" in message:  # what the JSON parser says of a lone surrogate
                message = (
                    f"{message}: a \\u escape is incomplete or a lone surrogate "
                    "(\\ud800-\\udfff), which is not Unicode; send the character itself or a "
                    "whole surrogate pair"
                )
        elif error["type"] == "extra_forbidden":
            message = "unknown field (the accepted ones are listed in docs/openai.md)"
        raise InvalidRequestError(where, value, message) from None


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods answer with an OpenAI error object too."""
    body = error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process that hosts it owns SIGINT/SIGTERM."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """A running uvicorn server; `await stop()` ends it."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task) -> None:
        self.server = server
        self.task = task

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http_server(
    app, host: str = "127.0.0.1", port: int = 8000, limits: HttpLimits | None = None
) -> tuple[HttpServer, int]:
    """Serve the ASGI `app` on host:port (0: a free port) in this event loop, under `limits`;
    returns the server and the bound port."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
    except OSError as error:
        raise HalfmoonError(
            f"cannot serve the HTTP API on {host}:{port} ({error}): the port is taken or the "
            "host is not local; pass another --http-port"
        ) from error
    server = _Server(uvicorn_config(app, limits or HttpLimits()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn has no event to await for this
        if task.done():
            task.result()
            raise HalfmoonError(f"the HTTP API on {host}:{port} stopped while starting")
        await asyncio.sleep(0.01)
    bound_port = sock.getsockname()[1]
    log.info("halfmoon OpenAI HTTP API on http://%s:%d/v1", host, bound_port)
    return HttpServer(server, task), bound_port
