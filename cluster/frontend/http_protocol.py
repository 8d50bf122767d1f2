"""uvicorn's h11 protocol with the `HttpLimits` uvicorn lacks: read deadlines and a connection
cap checked at accept.

uvicorn 0.54 bounds a request head's size (h11) and a kept-alive connection's idle time, but a
client that never finishes its head, or its body, holds the connection for good, and
`limit_concurrency` answers 503 only once a whole head has arrived: a flood of partial heads
still takes every descriptor. Here each connection has one deadline at a time, for the part
of the request being read, and the connections still sending their heads are the first to go
when a new one would exceed the cap.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import resource

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from halfmoon.cluster.frontend.http_errors import error_body, retry_after
from halfmoon.cluster.frontend.http_limits import HttpLimits
from halfmoon.cluster.frontend.rate_limited_log import RateLimitedLog, install

log = logging.getLogger(__name__)
TIMED_OUT = "HTTP connection closed: a request was not read within server.http_limits"
DISPLACED = "HTTP connections at the cap of %d: closed the oldest still sending its headers"
REFUSED = "HTTP connections at the cap of %d, every one with a request: refusing one (503)"
QUIET = RateLimitedLog(
    [
        TIMED_OUT,
        DISPLACED,
        REFUSED,
        "socket.accept() out of system resource",  # asyncio, when descriptors run out
        "Invalid HTTP request received.",  # uvicorn, per malformed request
    ]
)


def _request_timeout() -> bytes:
    """A whole 408 response that closes the connection, written without h11: h11 cannot answer
    a request whose head is incomplete."""
    body = json.dumps(error_body("the request was not sent in time", "timeout_error")).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REQUEST_TIMEOUT = _request_timeout()
# How long a timed-out connection, half-closed, still has its client's bytes read and dropped
# before it is closed: closing a socket with unread bytes sends a reset, which can reach the
# client before it has read the 408 (and with a flood of partial heads, a connection displaced
# at the cap may not have been read at all yet).
LINGER_S = 1.0
# The app of a connection over the cap: its request is read, then refused.
REFUSAL = JSONResponse(
    error_body("too many connections; retry later", "service_unavailable_error"),
    status_code=503,
    headers={"connection": "close"} | retry_after(503),
)


def descriptor_limit() -> float:
    """This process's limit on open files, sockets included."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return math.inf if soft == resource.RLIM_INFINITY else soft


class ConnectionGate:
    """What one server's connections share: the limits, the cap, and, oldest first, the
    connections still sending a request head (the ones a new connection may displace)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.max_connections = int(min(limits.max_connections, descriptor_limit() // 2))
        if self.max_connections < limits.max_connections:
            log.info(
                "HTTP connections capped at half the descriptor limit, %d", self.max_connections
            )
        self.heading: dict[GuardedProtocol, None] = {}

    def admit(self, num_open: int) -> bool:
        """Whether one more connection, making `num_open`, may be served: under the cap, or
        once the oldest one still sending its head is closed; else its request gets 503."""
        if num_open <= self.max_connections:
            return True
        if not self.heading:
            log.warning(REFUSED, self.max_connections)
            return False
        log.warning(DISPLACED, self.max_connections)
        next(iter(self.heading)).time_out(displaced=True)
        return True


class GuardedProtocol(H11Protocol):
    """One HTTP connection: a deadline on its request's head, then on its body, and none while
    the response is made; the cap of `gate` checked when it opens."""

    def __init__(self, *args, gate: ConnectionGate, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.reading: object = None  # the h11 state the deadline is for: IDLE head, SEND_BODY body
        self.deadline: asyncio.TimerHandle | None = None
        self.answered = False  # whether a response on this connection has been completed
        self.lingering = False  # timed out: half-closed, dropping what still arrives

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.gate.admit(len(self.connections)):
            # Answered once its head is in (h11 then closes it cleanly); a newer one displaces it.
            self.app = REFUSAL
        self._follow()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.answered = True
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop()

    def time_out(self, displaced: bool = False) -> None:
        """Close the connection, with a 408 if a request has begun and is not yet answered (an
        idle one is closed silently, as uvicorn closes a kept-alive one), or if it is
        `displaced` before it was ever answered (its head may be in, not yet read)."""
        self._stop()
        if self.transport.is_closing() or self.lingering:
            return
        if self._unanswered() or (displaced and not self.answered):
            self.transport.write(REQUEST_TIMEOUT)
        self._linger()

    def _linger(self) -> None:
        """Half-close once what was written is sent, drop what the client still sends, and
        close after `LINGER_S` (or when the client closes first)."""
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _unanswered(self) -> bool:
        """Whether some of a request has arrived and no response to it has begun."""
        state = self.conn.our_state
        return state is h11.SEND_RESPONSE or (
            state is h11.IDLE and bool(self.conn.trailing_data[0])
        )

    def _follow(self) -> None:
        """Arm the deadline of the part of the request being read; none once it is all in."""
        state = self.conn.their_state
        if self.transport.is_closing():
            self._stop()
        elif state is not self.reading:
            self._stop()
            if state is h11.IDLE:
                self.gate.heading[self] = None
                self._arm(state, self.gate.limits.header_timeout_s)
            elif state is h11.SEND_BODY:
                self._arm(state, self.gate.limits.body_timeout_s)

    def _arm(self, state: object, timeout_s: float) -> None:
        self.reading = state
        self.deadline = self.loop.call_later(timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        log.info(TIMED_OUT)
        self.time_out()

    def _stop(self) -> None:
        self.reading = None
        self.gate.heading.pop(self, None)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


def uvicorn_config(app, limits: HttpLimits, tls: tuple[str, str] | None = None) -> uvicorn.Config:
    """uvicorn's settings for `app` under `limits`: the guarded protocol, logging left to the
    hosting process (with its floods rate-limited), no lifespan; with `tls` (PEM certificate
    chain and key files), HTTPS."""
    cert, key = tls or (None, None)
    install(QUIET, [__name__, "asyncio", "uvicorn.error"])
    protocol = functools.partial(GuardedProtocol, gate=ConnectionGate(limits))
    return uvicorn.Config(
        app,
        http=protocol,  # type: ignore[arg-type]  # uvicorn calls it as it calls a class
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works
        h11_max_incomplete_event_size=limits.max_header_bytes,
        ssl_certfile=cert,
        ssl_keyfile=key,
    )
