"""Exceptions as HTTP statuses and OpenAI error objects: the same errors `grpc_errors` maps,
through its status codes, so both APIs always agree."""

from __future__ import annotations

import grpc

from halfmoon.cluster.frontend.grpc_errors import status_for
from halfmoon.cluster.serving.backend import ModelNotFoundError, UnauthenticatedError
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
