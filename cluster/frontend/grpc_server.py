"""The gRPC frontend: the `halfmoon.v1.Halfmoon` servicer over a `Backend`, health, reflection."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from halfmoon.cluster.api import halfmoon_pb2 as pb
from halfmoon.cluster.api import halfmoon_pb2_grpc as pb_grpc
from halfmoon.cluster.frontend.auth import ApiKeyInterceptor
from halfmoon.cluster.frontend.drain import Drain
from halfmoon.cluster.frontend.grammar_checks import GrammarChecks
from halfmoon.cluster.frontend.grpc_convert import (
    delta_to_proto,
    grammar_constraints,
    input_from_proto,
    model_info_to_proto,
)
from halfmoon.cluster.frontend.grpc_errors import abort_with
from halfmoon.cluster.frontend.grpc_wire import add_servicer
from halfmoon.cluster.frontend.request_limits import RequestLimits, check_request_id
from halfmoon.cluster.serving.backend import Backend, RejectedError
from halfmoon.cluster.version import package_version
from halfmoon.engine.errors import HalfmoonError, InvalidRequestError

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Halfmoon"].full_name
HEALTH_INTERVAL_S = 0.5  # how often the gRPC health status follows the backend's health()
_FOLLOWERS: set[asyncio.Task] = set()
MAX_MESSAGE_BYTES = 16 << 20  # above every default of RequestLimits (request_limits.py)
SERVER_OPTIONS = (
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def _mapped_errors(method):
    """Turn a unary handler's exceptions into gRPC statuses via `grpc_errors`."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error gets a status, internals hidden
            await abort_with(context, error)

    return wrapper


class HalfmoonServicer(pb_grpc.HalfmoonServicer):
    """Validates requests, streams the backend's deltas, maps errors to status codes."""

    def __init__(
        self,
        backend: Backend,
        limits: RequestLimits | None = None,
        grammars: GrammarChecks | None = None,
    ) -> None:
        self.backend = backend
        self.limits = limits or RequestLimits()
        self.grammars = grammars or GrammarChecks(self.limits)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            generate_input = input_from_proto(request, self.limits)
            await self.grammars.check(grammar_constraints(generate_input))
        except (InvalidRequestError, RejectedError) as error:
            await abort_with(context, error)
        remaining_s = context.time_remaining()
        deadline = None if remaining_s is None else asyncio.get_running_loop().time() + remaining_s
        deltas = self.backend.generate(generate_input)
        try:
            while True:
                # The deadline covers waiting on the backend only; a yield inside it is unsafe.
                async with asyncio.timeout_at(deadline):
                    delta = await anext(deltas, None)
                if delta is None:
                    return
                yield delta_to_proto(generate_input.request_id, delta)
        except Exception as error:  # noqa: BLE001 - every error gets a status, internals hidden
            await abort_with(context, error)
        finally:
            # Cancel and deadline land here too: closing the stream aborts the request.
            await deltas.aclose()

    @_mapped_errors
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        request_id = self._named(request.request_id, "abort")
        return pb.AbortResponse(aborted=await self.backend.abort(request_id))

    @_mapped_errors
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return model_info_to_proto(await self.backend.model_info())

    @_mapped_errors
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context) -> pb.ServerInfo:
        info = await self.backend.server_info()
        return pb.ServerInfo(
            version=package_version(),
            mode=str(info.get("mode", "")),
            model=str(info.get("model", "")),
            json=json.dumps(info, default=str),
        )

    @_mapped_errors
    async def ExplainDecision(self, request: pb.ExplainRequest, context) -> pb.Explanation:
        request_id = self._named(request.request_id, "explain")
        text = await self.backend.explain(request_id)
        return pb.Explanation(request_id=request_id, text=text)

    def _named(self, request_id: str, action: str) -> str:
        """The id of the request a call acts on: required, and within the request-id limits."""
        if not request_id:
            raise InvalidRequestError("request_id", "", f"name the request to {action}")
        check_request_id(request_id, self.limits)
        return request_id


async def start_grpc_server(
    backend: Backend,
    host: str = "127.0.0.1",
    port: int = 50051,
    limits: RequestLimits | None = None,
    drain: Drain | None = None,
    tls: tuple[bytes, bytes] | None = None,
    api_key: str | None = None,
    grammars: GrammarChecks | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve `backend` with health (following `backend.health()`) and reflection; returns the
    server and bound port.

    `port=0` picks a free port; `tls` is (certificate chain, private key) in PEM; `grammars`
    builds structured-output grammars (one shared with the HTTP API). With `api_key`,
    calls other than health checks need it as `authorization: Bearer` metadata. Stop with
    `await drain.drain(timeout_s)` (health turns NOT_SERVING, new requests are refused, the
    streams in flight finish), then `await server.stop(grace_s)`.
    """
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    add_servicer(HalfmoonServicer(backend, limits, grammars), server, drain or Drain())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await _report_health(backend, health_servicer)
    if drain is not None:  # after this the servicer ignores the follower's updates
        drain.on_drain(health_servicer.enter_graceful_shutdown)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound_port = server.add_insecure_port(address)
        else:
            certificate_chain, private_key = tls
            credentials = grpc.ssl_server_credentials([(private_key, certificate_chain)])
            bound_port = server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise HalfmoonError(
            f"cannot serve the gRPC API on {host}:{port} ({error}): "
            "the port is taken or the host is not local; pass another port"
        ) from error
    await server.start()
    follower = asyncio.get_running_loop().create_task(
        _follow_health(backend, health_servicer, server)
    )
    _FOLLOWERS.add(follower)  # the loop keeps only a weak reference to a task
    follower.add_done_callback(_FOLLOWERS.discard)
    log.info("halfmoon gRPC API on %s:%d%s", host, bound_port, " (TLS)" if tls else "")
    return server, bound_port


async def _report_health(backend: Backend, servicer: health.aio.HealthServicer) -> bool:
    """Set SERVING or NOT_SERVING from `backend.health()`; returns whether it is serving."""
    try:
        ok, reason = await backend.health()
    except Exception as error:  # noqa: BLE001 - a backend that cannot tell is not serving
        ok, reason = False, f"health check failed: {error!r}"
    status = health_pb2.HealthCheckResponse
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status.SERVING if ok else status.NOT_SERVING)
    if not ok:
        log.debug("health: NOT_SERVING (%s)", reason)
    return ok


async def _follow_health(
    backend: Backend, servicer: health.aio.HealthServicer, server: grpc.aio.Server
) -> None:
    """Keep the health status current until the server stops."""
    serving = True
    while await server.wait_for_termination(HEALTH_INTERVAL_S):  # True: timed out, still up
        now_serving = await _report_health(backend, servicer)
        if now_serving != serving:
            log.warning("health: %s", "SERVING" if now_serving else "NOT_SERVING")
            serving = now_serving
