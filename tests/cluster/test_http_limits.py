"""The HTTP API under hostile clients: read deadlines, the connection cap, the body bound read
as it streams, the head's size bound and rate-limited logs; real sockets against a real uvicorn
server over a LocalBackend."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_testkit import RunningApi, serve_openai

from halfmoon.cluster.config import ConfigError, load_config
from halfmoon.cluster.frontend.http_limits import HttpLimits
from halfmoon.cluster.frontend.http_protocol import QUIET, descriptor_limit
from halfmoon.cluster.frontend.rate_limited_log import RateLimitedLog

TIMEOUT_S = 0.5
FAST = HttpLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
# Both ends of each held connection are in this process.
NUM_HELD = int(min(3000, descriptor_limit() // 4))
MiB = 1 << 20


@pytest.fixture(scope="module")
def api(tiny_model_dir) -> Iterator[RunningApi]:
    with serve_openai(tiny_model_dir, http_limits=FAST) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_log_limits():
    """Each test sees the first of every rate-limited message."""
    QUIET.last_s.clear()
    QUIET.dropped.clear()


def _connect(api: RunningApi, data: bytes = b"") -> socket.socket:
    url = urlsplit(api.base_url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(data)
    return sock


def _answer_at_timeout(sock: socket.socket) -> bytes:
    """`_answer`, checking it came when the server's deadline (TIMEOUT_S) passed. The server
    counts from its accept, which may come a moment before this reads the clock (a close at
    0.4998 s was seen), hence the 20 ms of slack below the deadline."""
    start = time.monotonic()
    answer = _answer(sock)
    assert TIMEOUT_S - 0.02 <= time.monotonic() - start < TIMEOUT_S + 2.0
    return answer


def _answer(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout_s)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _response(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """One whole response (its head and its Content-Length of body) from a kept-alive `sock`."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _response_length(data):
        data += sock.recv(65536) or b"<closed>"
    return data


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    body = next((int(line[15:]) for line in lines if line.startswith(b"content-length:")), 0)
    return len(head) + 4 + body


def _healthy(api: RunningApi) -> bool:
    """HTTP answers a health check and a completion, and gRPC its health check."""
    health = httpx.get(api.base_url.removesuffix("/v1") + "/health", timeout=10)
    body = {"model": api.model, "prompt": "hi", "max_tokens": 2}
    completion = httpx.post(api.base_url + "/completions", json=body, timeout=10)
    with grpc.insecure_channel(api.grpc_address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    grpc_ok = check.status == health_pb2.HealthCheckResponse.SERVING
    return (health.status_code, completion.status_code, grpc_ok) == (200, 200, True)


@pytest.mark.timeout(30)
def test_a_partial_head_gets_408_and_is_closed_at_the_header_timeout(api):
    sock = _connect(api, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow")
    assert _answer_at_timeout(sock).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert _healthy(api)


@pytest.mark.timeout(30)
def test_a_silent_connection_is_closed_without_an_answer_at_the_header_timeout(api):
    sock = _connect(api)
    assert _answer_at_timeout(sock) == b""


@pytest.mark.timeout(30)
def test_a_body_short_of_its_content_length_gets_408_at_the_body_timeout(api):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    sock = _connect(api, head + b"0123456789")
    assert _answer_at_timeout(sock).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert _healthy(api)


@pytest.mark.timeout(30)
def test_a_kept_alive_connection_has_a_header_deadline_after_each_response(api):
    sock = _connect(api, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _response(sock).startswith(b"HTTP/1.1 200 OK\r\n")
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    assert _answer(sock).startswith(b"HTTP/1.1 408 Request Timeout\r\n")


@pytest.mark.timeout(30)
def test_a_head_still_incomplete_past_max_header_bytes_gets_400_at_once(api):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000
    start = time.monotonic()
    assert _answer(_connect(api, head)).startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert time.monotonic() - start < TIMEOUT_S
    assert _healthy(api)


@pytest.mark.timeout(60)
def test_thousands_of_partial_heads_are_closed_at_the_timeout_and_both_apis_answer(api, caplog):
    caplog.set_level(logging.INFO)
    held = [_connect(api, b"GET /v1/models HTTP/1.1\r\nHost") for _ in range(NUM_HELD)]
    start = time.monotonic()
    assert _healthy(api)
    assert len(_closed_by_server(held, TIMEOUT_S + 4.0)) == NUM_HELD
    assert time.monotonic() - start < TIMEOUT_S + 4.0
    assert _healthy(api)
    assert _log_bytes(caplog) < 2000, caplog.text
    _close(held)


@pytest.mark.timeout(60)
def test_partial_heads_beyond_the_cap_displace_the_oldest_and_both_apis_answer(
    tiny_model_dir, caplog
):
    caplog.set_level(logging.INFO)
    limits = HttpLimits(header_timeout_s=60.0, max_connections=200)
    with serve_openai(tiny_model_dir, http_limits=limits) as capped:
        held = [_connect(capped, b"GET /v1/models HTTP/1.1\r\nHost") for _ in range(NUM_HELD)]
        assert _healthy(capped)
        closed = _closed_by_server(held, 10.0, NUM_HELD - 200)
        assert NUM_HELD - 200 <= len(closed) < NUM_HELD
        assert all(_answer(sock).startswith(b"HTTP/1.1 408 ") for sock in closed[:10])
        assert _healthy(capped)
        assert _log_bytes(caplog) < 2000, caplog.text
        _close(held)  # before the server stops: it waits for its connections


def _closed_by_server(
    socks: list[socket.socket], wait_s: float, enough: int | None = None
) -> list[socket.socket]:
    """The sockets the server closes within `wait_s`, waiting only until `enough` (default:
    all) are closed; each one's answer is left unread."""
    closed: list[socket.socket] = []
    deadline = time.monotonic() + wait_s
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while len(closed) < (enough or len(socks)) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                selector.unregister(key.fileobj)
                closed.append(key.fileobj)
    return closed


def _log_bytes(caplog) -> int:
    return sum(len(caplog.handler.format(record)) for record in caplog.records)


def _close(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


@pytest.mark.timeout(30)
def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503(tiny_model_dir):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    with serve_openai(tiny_model_dir, http_limits=HttpLimits(max_connections=2)) as api:
        busy = [_connect(api, head) for _ in range(2)]
        try:
            for sock in busy:  # once the app reads the body, the head is in
                assert _response(sock).startswith(b"HTTP/1.1 100 Continue\r\n")
            refused = _answer(_connect(api, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            assert b"too many connections" in refused
            busy[0].sendall(b"{}" * 5)  # a busy one is still served
            assert _response(busy[0]).startswith(b"HTTP/1.1 400 Bad Request\r\n")
        finally:
            _close(busy)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_300_mb_body_is_refused_while_server_memory_grows_under_50_mib(api, chunked):
    rss_before = _rss_bytes()
    sender = _BodySender(api, 300_000_000, chunked)
    sender.start()
    rss_peak = rss_before
    while sender.is_alive():
        sender.join(0.01)
        rss_peak = max(rss_peak, _rss_bytes())
    assert sender.answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), sender.answer[:200]
    assert b'"param":"body"' in sender.answer
    assert rss_peak - rss_before < 50 * MiB
    assert sender.sent_bytes < 64 * MiB  # answered long before the 300 MB were sent
    assert _healthy(api)


class _BodySender(threading.Thread):
    """Streams a huge JSON body in 64 KiB pieces (one piece, reused) until the server answers;
    keeps the answer's first bytes and the number of body bytes sent."""

    def __init__(self, api: RunningApi, size: int, chunked: bool) -> None:
        super().__init__(daemon=True)
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n" % framing
        frame = _chunk if chunked else bytes
        self.sock = _connect(api, head + frame(b'{"prompt": "'))
        self.piece = frame(b"x" * 65536)
        self.size, self.sent_bytes, self.answer = size, 0, b""

    def run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            while self.sent_bytes < self.size and not selector.select(0):
                self.sock.sendall(self.piece)
                self.sent_bytes += 65536
        self.answer = _response(self.sock)
        self.sock.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_flood_of_one_message_is_logged_once_per_interval_with_its_count(caplog):
    now = [0.0]
    quiet = RateLimitedLog(["socket.accept() out of system resource"], 10.0, lambda: now[0])
    logger = logging.getLogger("test_http_limits.flood")
    logger.addFilter(quiet)
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(10_000):
            logger.error("socket.accept() out of system resource\nsocket: <fd 7>")
        logger.error("another message")
        now[0] = 10.0
        logger.error("socket.accept() out of system resource\nsocket: <fd 7>")
    assert [record.getMessage() for record in caplog.records] == [
        "socket.accept() out of system resource\nsocket: <fd 7>",
        "another message",
        "socket.accept() out of system resource\nsocket: <fd 7>"
        " [and 9999 more like it since the last one logged]",
    ]


def test_http_limits_are_read_from_the_server_section():
    config = load_config(None, {"server.http_limits.header_timeout_s": 2.5})
    assert config.server.http_limits == HttpLimits(header_timeout_s=2.5)
    assert load_config(None, {}).server.http_limits == HttpLimits()
    with pytest.raises(ConfigError, match="server.http_limits.max_connections"):
        load_config(None, {"server.http_limits.max_connections": 0})
