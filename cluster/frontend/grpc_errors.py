"""The one place exceptions become gRPC status codes, on the server and back on the client."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from halfmoon.cluster.serving.backend import (
    DuplicateRequestError,
    ModelNotFoundError,
    NoWorkerError,
    RejectedError,
    UnauthenticatedError,
)
from halfmoon.cluster.worker.errors import WorkerCallError
from halfmoon.engine.errors import (
    HalfmoonError,
    InvalidRequestError,
    OutOfPagesError,
    RequestNotFoundError,
)

log = logging.getLogger(__name__)
# Trailing metadata that marks a status as sent by a halfmoon server (not by the transport).
ERROR_KEY = "halfmoon-error"
# Status messages travel in a header; gRPC fails a call whose headers exceed 8 KiB.
MAX_MESSAGE_CHARS = 1024
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (RejectedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkerError, grpc.StatusCode.UNAVAILABLE),
    (OutOfPagesError, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (asyncio.CancelledError, grpc.StatusCode.CANCELLED),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and the message a client may see for `error`."""
    if isinstance(error, WorkerCallError):  # a worker's error, sent back as data
        code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.INTERNAL)
        return code, _message(error, code)
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code, bounded(_message(error, code))
    incident = uuid.uuid4().hex[:12]
    log.error("internal error (incident %s)", incident, exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal server error; see incident {incident} in its log"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the RPC with the status `error` maps to; raises, as `context.abort` does."""
    code, message = status_for(error)
    await context.abort(code, message, trailing_metadata=((ERROR_KEY, type(error).__name__),))


class ServerError(HalfmoonError):
    """A call failed; `code` is the gRPC status name (e.g. `INVALID_ARGUMENT`)."""

    def __init__(self, code: str, message: str, from_server: bool = True) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.from_server = from_server

    @property
    def unreachable(self) -> bool:
        """True when no halfmoon server answered (nothing listening, or the link failed)."""
        return self.code == "UNAVAILABLE" and not self.from_server

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> ServerError:
        """The `ServerError` for a failed sync or asyncio call."""
        metadata = error.trailing_metadata() or ()
        from_server = any(key == ERROR_KEY for key, _ in metadata)
        return cls(error.code().name, error.details() or "", from_server)


def bounded(message: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `max_chars` characters, saying how much was left out."""
    if len(message) <= max_chars:
        return message
    return f"{message[:max_chars]}... ({len(message) - max_chars} more characters)"


def _message(error: BaseException, code: grpc.StatusCode) -> str:
    if isinstance(error, HalfmoonError) and str(error):
        return str(error)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "the request's deadline expired before it finished"
    return "the request was cancelled"
