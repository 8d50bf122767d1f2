"""Exceptions map to gRPC status codes in one place, and clients can tell server from transport."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.frontend.grpc_errors import status_for
from halfmoon.cluster.frontend.grpc_server import start_grpc_server
from halfmoon.cluster.serving.backend import DuplicateRequestError, NoWorkerError, RejectedError
from halfmoon.cluster.worker.errors import WorkerCallError, WorkerError
from halfmoon.engine.errors import InvalidRequestError, OutOfPagesError, RequestNotFoundError


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (
            InvalidRequestError("top_p", 2.0, "must be in (0, 1]"),
            "INVALID_ARGUMENT",
            "top_p=2.0 is invalid: must be in (0, 1]",
        ),
        (RejectedError("TTFT breaks the SLO"), "RESOURCE_EXHAUSTED", "TTFT breaks the SLO"),
        (NoWorkerError("no decode worker is alive"), "UNAVAILABLE", "no decode worker is alive"),
        (OutOfPagesError(4, 1), "UNAVAILABLE", "needs 4 free KV pages, 1 are free"),
        (RequestNotFoundError("r"), "NOT_FOUND", "no request 'r' is in flight"),
        (
            RequestNotFoundError("r", "among the recent ones"),
            "NOT_FOUND",
            "no request 'r' is among the recent ones",
        ),
        (TimeoutError(), "DEADLINE_EXCEEDED", "the request's deadline expired before it finished"),
        (asyncio.CancelledError(), "CANCELLED", "the request was cancelled"),
        (DuplicateRequestError("request_id='a' is in flight"), "ALREADY_EXISTS", None),
        # A worker's error comes back as data and keeps its status (Ray cannot rebuild it).
        (WorkerCallError(WorkerError("INVALID_ARGUMENT", "n=1 is bad")), "INVALID_ARGUMENT", None),
        (WorkerCallError(WorkerError.of(OutOfPagesError(4, 1))), "UNAVAILABLE", None),
        (WorkerCallError(WorkerError("NO_SUCH_CODE", "odd")), "INTERNAL", "odd"),
    ],
)
def test_each_error_maps_to_its_status_and_message(error, code, message):
    assert status_for(error) == (getattr(grpc.StatusCode, code), message or str(error))


def test_a_workers_error_becomes_data_that_keeps_its_status():
    invalid = InvalidRequestError("top_p", 2.0, "must be in (0, 1]")
    assert WorkerError.of(invalid) == WorkerError("INVALID_ARGUMENT", str(invalid))
    assert WorkerError.of(OutOfPagesError(4, 1)).code == "UNAVAILABLE"
    assert WorkerError.of(RequestNotFoundError("r")).code == "NOT_FOUND"


def test_a_renamed_error_names_the_field_as_the_client_sent_it():
    error = InvalidRequestError("max_tokens", 9, "prompt plus max_tokens must fit; max_tokens_x")
    renamed = error.renamed("max_completion_tokens")
    assert (renamed.field, renamed.value) == ("max_completion_tokens", 9)
    assert str(renamed) == (
        "max_completion_tokens=9 is invalid: prompt plus max_completion_tokens must fit; "
        "max_tokens_x"
    )


def test_unexpected_errors_are_internal_and_do_not_leak_details():
    status, message = status_for(KeyError("/secret/path/weights.bin"))
    assert status is grpc.StatusCode.INTERNAL
    assert "secret" not in message
    assert message.startswith("internal server error; see incident ")


class FailingBackend:
    """A backend whose every request fails with one error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def generate(self, request):
        raise self.error
        yield  # an async generator, like a real backend

    async def abort(self, request_id: str) -> bool:
        raise self.error

    async def health(self) -> tuple[bool, str]:
        return True, "serving"


@pytest.fixture
def serve_failing():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = []

    def serve(error: Exception) -> str:
        start = start_grpc_server(FailingBackend(error), port=0)
        server, port = asyncio.run_coroutine_threadsafe(start, loop).result()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RejectedError("predicted TTFT 3.0 s breaks the 1.0 s SLO"), "RESOURCE_EXHAUSTED"),
        (NoWorkerError("no decode worker is alive"), "UNAVAILABLE"),
        (RuntimeError("boom at 0x7f00"), "INTERNAL"),
    ],
)
def test_backend_errors_reach_the_client_as_status_codes(serve_failing, error, code):
    with Client(serve_failing(error)) as client:
        with pytest.raises(ServerError) as caught:
            client.complete("hi")
        with pytest.raises(ServerError) as caught_abort:
            client.abort("some-id")
    for failure in (caught.value, caught_abort.value):
        assert failure.code == code
        assert failure.from_server and not failure.unreachable
        assert "0x7f00" not in failure.message
