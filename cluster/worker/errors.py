"""Errors that cross an actor boundary as data: Ray cannot rebuild halfmoon's exception types
on the caller's side, so a worker returns a `WorkerError` and the caller raises it again."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.engine.errors import (
    DeviceFailedError,
    HalfmoonError,
    InvalidRequestError,
    OutOfPagesError,
    RequestNotFoundError,
)

# The gRPC status name each error a worker raises on purpose stands for.
CODE_BY_ERROR: tuple[tuple[type[HalfmoonError], str], ...] = (
    (InvalidRequestError, "INVALID_ARGUMENT"),
    (RequestNotFoundError, "NOT_FOUND"),
    (OutOfPagesError, "UNAVAILABLE"),
    (DeviceFailedError, "UNAVAILABLE"),  # the worker is being replaced: another one serves
)


@dataclass(frozen=True, slots=True)
class WorkerError:
    """A worker call's failure: a gRPC status name and a message fit for the client.
    `retryable`: nothing of the request was computed here, so the router may run it again on
    other workers (e.g. its KV never reached the decode worker)."""

    code: str
    message: str
    retryable: bool = False

    @classmethod
    def of(cls, error: HalfmoonError) -> WorkerError:
        # A failed device refused the request before computing any of it: run it elsewhere.
        retryable = isinstance(error, DeviceFailedError)
        for error_type, code in CODE_BY_ERROR:
            if isinstance(error, error_type):
                return cls(code, str(error), retryable)
        return cls("INTERNAL", str(error))


class WorkerCallError(HalfmoonError):
    """A worker answered a call with a `WorkerError`; `code` is its gRPC status name."""

    def __init__(self, error: WorkerError) -> None:
        super().__init__(error.message)
        self.code = error.code
        self.retryable = error.retryable


def aborted(request_id: str) -> WorkerError:
    return WorkerError("CANCELLED", f"request {request_id} was aborted")


def unwrap(result):
    """`result` itself, or `WorkerCallError` when a worker answered with a `WorkerError`."""
    if isinstance(result, WorkerError):
        raise WorkerCallError(result)
    return result
