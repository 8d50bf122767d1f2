"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), served beside gRPC from the same
`Backend`: /v1/models[/{id}], /v1/completions, /v1/chat/completions (SSE streams), vLLM's
/tokenize and /detokenize, /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from functools import partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from halfmoon.cluster.frontend.auth import UNAUTHENTICATED_MESSAGE, bearer_matches
from halfmoon.cluster.frontend.drain import Drain
from halfmoon.cluster.frontend.grammar_checks import GrammarChecks
from halfmoon.cluster.frontend.http_errors import (
    NO_WORKER_RETRY_AFTER_S,
    error_body,
    http_error,
    retry_after,
)
from halfmoon.cluster.frontend.http_limits import HttpLimits
from halfmoon.cluster.frontend.http_protocol import uvicorn_config
from halfmoon.cluster.frontend.http_request import (
    REQUEST_ID_HEADER,
    ClientGone,
    check_json,
    parse,
    read_body,
    request_id_of,
)
from halfmoon.cluster.frontend.http_stream import EventStream, Relay, sse_events, unless_client_gone
from halfmoon.cluster.frontend.openai_responses import CHAT, COMPLETION, ResponseShape
from halfmoon.cluster.frontend.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from halfmoon.cluster.frontend.openai_tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from halfmoon.cluster.frontend.openai_tool_prompt import render_with_tools
from halfmoon.cluster.frontend.request_limits import (
    RequestLimits,
    check_prompt,
    check_stops,
)
from halfmoon.cluster.serving.backend import (
    Backend,
    ModelInfo,
    ModelNotFoundError,
    UnauthenticatedError,
)
from halfmoon.cluster.serving.prompts import PromptTokenizer, prompt_chars
from halfmoon.engine.errors import HalfmoonError, InvalidRequestError

log = logging.getLogger(__name__)
CLIENT_GONE_STATUS = 499  # nginx's "client closed request"; nobody reads it
BODY_OVERHEAD_BYTES = 1 << 20  # JSON fields around the prompt: sampling options, stops, ids


class RequestIdHeader:
    """ASGI middleware: every response carries an X-Request-Id, a new one where the route set
    none (an unknown path or method, /health, /metrics)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).setdefault(REQUEST_ID_HEADER, uuid.uuid4().hex)
            await send(message)

        await self.app(scope, receive, send_with_id)


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
        grammars: GrammarChecks | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()
        self.drain = drain or Drain()
        self.tokenizer = tokenizer
        self.model = model
        self.prompts = PromptTokenizer(tokenizer, model.vocab_size, model.max_model_len)
        self.registry = registry
        self.api_key = api_key
        self.created = int(time.time())
        self.grammars = grammars or GrammarChecks(self.limits)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="halfmoon OpenAI-compatible API", docs_url=None, redoc_url=None)
        read = ["GET", "HEAD"]  # HEAD: probes such as AIPerf's readiness check
        app.add_api_route("/v1/models", self.models, methods=read)
        app.add_api_route("/v1/models/{model_id:path}", self.model_card, methods=read)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/health", self.health, methods=read)
        app.add_api_route("/metrics", self.metrics, methods=read)
        app.add_exception_handler(HTTPException, _http_exception)
        app.add_middleware(RequestIdHeader)
        return app

    async def models(self, request: Request) -> Response:
        return await self._answer(request, self._models)

    async def model_card(self, request: Request, model_id: str) -> Response:
        return await self._answer(request, lambda rid: self._model_card(model_id))

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._generate(request, rid, COMPLETION))

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._generate(request, rid, CHAT))

    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._tokens(request, TokenizeRequest))

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, lambda rid: self._tokens(request, DetokenizeRequest))

    async def health(self) -> Response:
        ok, reason = await self.backend.health()
        if self.drain.draining:
            ok, reason = False, "shutting down"
        body = {"status": "ok" if ok else "unavailable", "reason": reason}
        status = 200 if ok else 503
        wait_s = self.drain.seconds_left() if self.drain.draining else NO_WORKER_RETRY_AFTER_S
        return JSONResponse(body, status, headers=retry_after(status, seconds=wait_s))

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
            request_id = request_id_of(request, self.limits) or request_id
            response = await handler(request_id)
        except ClientGone:
            response = Response(status_code=CLIENT_GONE_STATUS)
        except Exception as error:  # noqa: BLE001 - every error gets a status, internals hidden
            status, body = http_error(error)
            response = JSONResponse(body, status, headers=retry_after(status, error))
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    def _authorize(self, request: Request) -> None:
        if self.api_key and not bearer_matches(request.headers.get("authorization"), self.api_key):
            raise UnauthenticatedError(UNAUTHENTICATED_MESSAGE)

    async def _models(self, request_id: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def _model_card(self, model_id: str) -> Response:
        self._check_model(model_id)
        return JSONResponse(self._card())

    def _card(self) -> dict:
        return {
            "id": self.model.model,
            "object": "model",
            "created": self.created,
            "owned_by": "halfmoon",
            "max_model_len": self.model.max_model_len,
        }

    async def _generate(self, request: Request, request_id: str, kind: str) -> Response:
        schema = ChatCompletionRequest if kind == CHAT else CompletionRequest
        self.drain.check_open()
        raw = await read_body(request, self.limits.max_prompt_bytes + BODY_OVERHEAD_BYTES)
        check_json(request.headers.get("content-type"))
        body = parse(schema, raw)
        try:
            return await self._serve(request, request_id, kind, body)
        except InvalidRequestError as error:
            raise body.as_sent(error) from None

    async def _tokens(self, request: Request, schema: type) -> Response:
        """/tokenize or /detokenize (vLLM's) with the served model's tokenizer."""
        raw = await read_body(request, self.limits.max_prompt_bytes + BODY_OVERHEAD_BYTES)
        check_json(request.headers.get("content-type"))
        body = parse(schema, raw)
        self._check_model(body.model)
        work = tokenize if schema is TokenizeRequest else detokenize
        return JSONResponse(await work(body, self.prompts, self.limits))

    async def _serve(
        self, request: Request, request_id: str, kind: str, body: OpenAIRequest
    ) -> Response:
        """Check `body` against the model and the limits, run it, answer (whole or streamed)."""
        self._check_model(body.model)
        prompt = body.to_prompt()
        check_prompt(prompt, self.limits)
        if isinstance(body, ChatCompletionRequest) and body.renders_tools():
            prompt = await self._with_tools(prompt, body.tools_for_template())
        generate_input = body.to_input(request_id, prompt, self.model)
        params = generate_input.params
        check_stops(params.stop, len(params.stop_token_ids), self.limits)
        await self.grammars.check(body.grammar_constraints())
        shape = ResponseShape(kind, request_id, self.model.model, self.tokenizer, n=params.n)
        if isinstance(body, CompletionRequest):
            shape.echo = body.echo_text(prompt, self.tokenizer)
        else:
            shape.calling = body.tool_calling()
        relay = Relay(self.backend, generate_input, self.drain)
        if not body.stream:
            deltas = await unless_client_gone(request, relay, relay.collect())
            return JSONResponse(shape.response(deltas))
        # The first delta before the headers: an error up to here gets its own HTTP status.
        first = await unless_client_gone(request, relay, relay.next())
        shape.include_usage, shape.continuous_usage = body.include_usage, body.continuous_usage
        return EventStream(sse_events(relay, first, shape))

    async def _with_tools(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """The token ids of a chat with tools (or earlier calls), rendered here: the backends'
        prompts carry no tools."""
        encode = partial(render_with_tools, messages=messages, tools=tools)
        return await self.prompts.run(encode, prompt_chars(messages) + len(json.dumps(tools)))

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.model:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; this server serves {self.model.model!r} "
                "(see GET /v1/models)"
            )


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods answer with an OpenAI error object too."""
    body = error_body(str(exc.detail), "invalid_request_error", code=str(exc.status_code))
    headers = retry_after(exc.status_code) | dict(exc.headers or {})
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


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
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: HttpLimits | None = None,
    tls: tuple[str, str] | None = None,
) -> tuple[HttpServer, int]:
    """Serve the ASGI `app` on host:port (0: a free port) in this event loop, under `limits`,
    over HTTPS with `tls` (PEM certificate chain and key files); returns the server and the
    bound port."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family)
    except OSError as error:
        raise HalfmoonError(
            f"cannot serve the HTTP API on {host}:{port} ({error}): the port is taken or the "
            "host is not local; pass another --http-port"
        ) from error
    server = _Server(uvicorn_config(app, limits or HttpLimits(), tls))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn has no event to await for this
        if task.done():
            task.result()
            raise HalfmoonError(f"the HTTP API on {host}:{port} stopped while starting")
        await asyncio.sleep(0.01)
    bound_port = sock.getsockname()[1]
    scheme = "https" if tls else "http"
    log.info("halfmoon OpenAI HTTP API on %s://%s:%d/v1", scheme, host, bound_port)
    return HttpServer(server, task), bound_port
