"""The API key check, shared by the HTTP API (`Authorization: Bearer` header) and gRPC (the
same `authorization` metadata, checked by a server interceptor)."""

from __future__ import annotations

import hmac
import ipaddress

import grpc

from halfmoon.cluster.frontend.grpc_errors import ERROR_KEY

AUTH_METADATA = "authorization"
API_KEY_ENV = "HALFMOON_API_KEY"  # where clients and `serve` read the key when no flag gives it
# Health probes (load balancers, Kubernetes) carry no key.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_MESSAGE = (
    "missing or wrong API key: send `authorization: Bearer KEY` (the key given to "
    "`halfmoon serve --api-key` or $HALFMOON_API_KEY)"
)
HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to


def bearer_matches(header: str | None, api_key: str) -> bool:
    """True when `header` is `Bearer <api_key>` (compared in constant time)."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The gRPC call metadata that presents `api_key` (None: no key, no metadata)."""
    return ((AUTH_METADATA, f"Bearer {api_key}"),) if api_key else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call (health checks aside) without the API key."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        header = dict(details.invocation_metadata or ()).get(AUTH_METADATA)
        if bearer_matches(header, self.api_key):
            return handler
        factory = HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        return factory(
            _deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def _deny(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        UNAUTHENTICATED_MESSAGE,
        trailing_metadata=((ERROR_KEY, "Unauthenticated"),),
    )
