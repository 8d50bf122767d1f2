"""The bad-input matrix of issue 35 against one real cluster: every bad HTTP request and gRPC
call (the tables in bad_inputs.py) gets its precise answer (the exact status, the field or
problem named, never a 5xx, INTERNAL or UNKNOWN) within seconds, and both APIs still serve
after each one. HTTP goes over raw sockets, so any bytes, header or method can be sent."""

from __future__ import annotations

import json
import selectors
import socket
import time
from dataclasses import dataclass

import grpc
import pytest
import requests
from bad_inputs import (
    COMPLETION_BODY,
    COMPLETIONS,
    GRPC_CASES,
    HTTP_CASES,
    MALFORMED_HTTP,
    MAX_MODEL_LEN,
    MODEL,
    ROUTES,
    VOCAB_SIZE,
    GrpcCase,
    HttpCase,
    RouteCase,
)
from cluster_kit import counters, running_cluster, wait_until
from grpc_health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpc_health.v1.health_pb2_grpc import HealthStub

from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.cluster.frontend.grpc_server import SERVICE_NAME

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

ANSWER_S = 5.0  # every answer, refusal or not, comes within this
SERVE_EVERY = 10  # cases between two real requests on both APIs (health is checked after each)
WAIT_S = 20.0  # how long a socket or a call waits before the case counts as hung
PIECE_BYTES = 1 << 16
LONG = {"max_tokens": 1900, "ignore_eos": True}


@dataclass
class Served:
    cluster: Cluster
    client: Client
    channel: grpc.Channel
    http_port: int
    num_cases: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """One colocated cluster for the module: every field is checked at the router, before a
    worker sees the request, so a prefill pool would add start-up time and nothing checked."""
    settings = {
        "mode": "colocated",
        "served_model_name": MODEL,
        # as served by default: a bad grammar is not also waiting for the builder to load
        "limits.grammar_builder_at_start": True,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        info = client.model_info()
        assert (info.max_model_len, info.vocab_size) == (MAX_MODEL_LEN, VOCAB_SIZE)
        with grpc.insecure_channel(f"127.0.0.1:{cluster.ports['grpc_port']}") as channel:
            running = Served(cluster, client, channel, cluster.ports["http_port"])
            # gRPC health polls the backend every HEALTH_INTERVAL_S: SERVING just after start
            wait_until(lambda: _grpc_health(running) == HealthCheckResponse.SERVING)
            yield running


@pytest.fixture(autouse=True)
def still_serving(served):
    """After every case (an xfailed one too) both APIs report healthy; after every
    SERVE_EVERY-th, each also serves a request."""
    yield
    assert requests.get(served.base_url + "/health", timeout=WAIT_S).status_code == 200
    assert _grpc_health(served) == HealthCheckResponse.SERVING
    served.num_cases += 1
    if served.num_cases % SERVE_EVERY == 0:
        _assert_serves(served)


def _grpc_health(served: Served) -> int:
    return HealthStub(served.channel).Check(HealthCheckRequest(), timeout=WAIT_S).status


def _assert_serves(served: Served) -> None:
    body = {**COMPLETION_BODY, "max_tokens": 1, "ignore_eos": True}
    answer = requests.post(served.base_url + COMPLETIONS, json=body, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    completion = served.client.complete("ok", max_tokens=1, ignore_eos=True, timeout=WAIT_S)
    assert completion.finish_reason == "length"


def _params(cases) -> list:
    return [
        pytest.param(case, id=case.name, marks=_xfail(getattr(case, "bug", None))) for case in cases
    ]


def _xfail(bug: str | None) -> list:
    return [pytest.mark.xfail(strict=True, reason=bug)] if bug else []


@pytest.mark.parametrize("case", _params(HTTP_CASES))
def test_a_bad_http_request_gets_an_error_naming_what_is_wrong(served, case: HttpCase):
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    content_type = () if case.content_type is None else ((b"Content-Type", case.content_type),)
    headers = (*content_type, *case.headers)
    answer = exchange(served.http_port, http_request(case.method, case.path, body, headers))
    assert answer.elapsed_s < ANSWER_S
    assert answer.status == case.status, answer.body[:500]
    error = answer.error()
    assert (error["param"], error["code"], error["type"]) == (
        case.param,
        case.code,
        "invalid_request_error",
    )
    if case.param is not None:
        assert error["message"].startswith(f"{case.param}="), error["message"]
    assert case.says in error["message"]
    assert answer.headers["x-request-id"]


@pytest.mark.parametrize("case", _params(ROUTES))
def test_a_method_or_path_not_served_gets_404_or_405(served, case: RouteCase):
    answer = exchange(served.http_port, http_request(case.method, case.path))
    assert answer.elapsed_s < ANSWER_S
    assert answer.status == case.status
    assert _methods(answer.headers.get("allow")) == _methods(case.allow)
    message = {404: "Not Found", 405: "Method Not Allowed"}[case.status]
    assert answer.error() == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": str(case.status),
    }
    assert answer.headers["x-request-id"]


@pytest.mark.parametrize("raw", list(MALFORMED_HTTP.values()), ids=list(MALFORMED_HTTP))
def test_malformed_http_gets_400_and_the_connection_is_closed(served, raw: bytes):
    answer = exchange(served.http_port, raw)
    assert answer.elapsed_s < ANSWER_S
    assert answer.status == 400
    assert answer.headers["connection"].lower() == "close"
    assert b"Invalid HTTP request received." in answer.body


@pytest.mark.parametrize("case", _params(GRPC_CASES))
def test_a_bad_grpc_call_gets_its_status_naming_what_is_wrong(served, case: GrpcCase):
    start = time.monotonic()
    error = _failed_call(served.channel, case)
    assert time.monotonic() - start < ANSWER_S
    assert error.code().name == case.code, error.details()
    message = error.details()
    if case.field is not None:
        assert message.startswith(f"{case.field}="), message
    assert case.says in message


def test_an_abort_of_an_unknown_or_finished_request_answers_not_aborted(served):
    client = served.client
    assert client.abort("never-sent", timeout=WAIT_S) is False
    client.complete("done", request_id="finished", max_tokens=1, timeout=WAIT_S)
    assert client.abort("finished", timeout=WAIT_S) is False


def test_a_grpc_request_id_in_flight_is_refused_and_the_first_goes_on(served):
    client = served.client
    with client.generate("first", request_id="twice", timeout=WAIT_S, **LONG) as first:
        next(first)
        with pytest.raises(ServerError) as caught:
            client.complete("second", request_id="twice", max_tokens=1, timeout=WAIT_S)
        assert caught.value.code == "ALREADY_EXISTS"
        assert "'twice'" in caught.value.message
        assert next(first).finish_reason is None
    _wait_until_idle(served)


def test_a_deadline_mid_generation_ends_the_call_and_frees_the_request(served):
    start = time.monotonic()
    with pytest.raises(ServerError) as caught:
        served.client.complete("too slow", timeout=0.3, **LONG)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - start < 0.3 + ANSWER_S
    _wait_until_idle(served)


def test_after_the_matrix_both_apis_serve_and_no_request_or_page_is_left(served):
    _assert_serves(served)
    _wait_until_idle(served)


def _wait_until_idle(served: Served) -> None:
    wait_until(lambda: served.client.server_info().details["in_flight"] == 0)
    for name in served.cluster.workers:
        wait_until(lambda n=name: counters(served.cluster, n)["num_used_pages"] == 0)


def _failed_call(channel: grpc.Channel, case: GrpcCase) -> grpc.RpcError:
    """Send the case's request (a message, or raw bytes) and return the call's error."""
    request = case.message()
    serialize = bytes if isinstance(request, bytes) else type(request).SerializeToString
    streaming = case.rpc == "Generate"
    make = channel.unary_stream if streaming else channel.unary_unary
    call = make(f"/{SERVICE_NAME}/{case.rpc}", serialize, bytes)
    try:
        answer = call(request, timeout=case.timeout_s)
        if streaming:
            list(answer)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{case.rpc} succeeded")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    elapsed_s: float

    def error(self) -> dict:
        return json.loads(self.body)["error"]


def http_request(
    method: str, path: str, body: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = ()
) -> bytes:
    """An HTTP/1.1 request that asks the server to close the connection after answering."""
    lines = [
        b"%s %s HTTP/1.1" % (method.encode(), path.encode()),
        b"Host: 127.0.0.1",
        b"Content-Length: %d" % len(body),
        b"Connection: close",
        *(b"%s: %s" % header for header in headers),
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def exchange(port: int, request: bytes) -> Answer:
    """Send `request` on a new connection and read the answer."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        _send(sock, request)
        data = _receive(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return Answer(
        int(status_line.split()[1]),
        {name.lower(): value for name, value in headers.items()},
        _unchunked(body) if headers.get("Transfer-Encoding") == "chunked" else body,
        time.monotonic() - start,
    )


def _send(sock: socket.socket, request: bytes) -> None:
    """Send `request`, stopping once the server answers (it refuses a body too large by its
    Content-Length, before reading it)."""
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        for offset in range(0, len(request), PIECE_BYTES):
            if selector.select(0):
                return
            try:
                sock.sendall(request[offset : offset + PIECE_BYTES])
            except (BrokenPipeError, ConnectionResetError):
                return


def _receive(sock: socket.socket) -> bytes:
    """The answer: until the server closes, or until its Content-Length is in (a server that
    closes with part of the request unread resets the connection)."""
    data = b""
    try:
        while (chunk := sock.recv(65536)) and not _complete(data := data + chunk):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"no answer within {WAIT_S} s; got {data[:200]!r}") from None
    return data


def _complete(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    lengths = [
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    return bool(found and lengths) and len(body) >= lengths[0]


def _unchunked(body: bytes) -> bytes:
    """The payload of a chunked body."""
    payload = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        payload, body = payload + body[:size], body[size + 2 :]
    return payload


def _methods(allow: str | None) -> set[str] | None:
    return None if allow is None else set(allow.split(", "))
