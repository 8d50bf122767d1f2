"""Exceptions as HTTP statuses and OpenAI error objects: the same errors `grpc_errors` maps,
through its status codes, so both APIs always agree."""

from __future__ import annotations

import grpc

from halfmoon.cluster.frontend.grpc_errors import status_for
from halfmoon.cluster.serving.backend import (
    ModelNotFoundError,
    NoWorkerError,
    UnauthenticatedError,
)
from halfmoon.engine.errors import InvalidRequestError

# gRPC status -> (HTTP status, OpenAI error type).
HTTP_BY_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# OpenAI's own codes where one exists; otherwise the gRPC status name.
CODE_BY_ERROR = {ModelNotFoundError: "model_not_found", UnauthenticatedError: "invalid_api_key"}
# Statuses that say "try again later": their answers carry a Retry-After header.
RETRY_STATUSES = (429, 503)
# A pool without a live worker waited router.pool_wait_s already: a restart takes seconds.
NO_WORKER_RETRY_AFTER_S = 5
# Load (an SLO rejection, a full KV cache, the connection cap) moves within a request's TTFT.
LOAD_RETRY_AFTER_S = 1


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    """An OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_error(error: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error object for `error` (internals hidden, as on gRPC)."""
    code, message = status_for(error)
    status, type_ = HTTP_BY_STATUS[code]
    param = error.field if isinstance(error, InvalidRequestError) else None
    name = CODE_BY_ERROR.get(type(error), code.name.lower())
    return status, error_body(message, type_, param, name)


def retry_after(
    status: int, error: BaseException | None = None, seconds: int | None = None
) -> dict[str, str]:
    """The Retry-After header (whole seconds) of a 429 or 503 answer, none for the others:
    `seconds`, else what `error` knows (`retry_after_s`, e.g. the time left in a drain), else
    by the kind of error."""
    if status not in RETRY_STATUSES:
        return {}
    if seconds is None:
        seconds = getattr(error, "retry_after_s", None)
    if seconds is None:
        no_worker = isinstance(error, NoWorkerError)
        seconds = NO_WORKER_RETRY_AFTER_S if no_worker else LOAD_RETRY_AFTER_S
    return {"Retry-After": str(seconds)}
