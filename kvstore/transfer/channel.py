"""Notices from a prefill worker straight to a decode worker on the same node.

On one node the KV itself already moves through the store's shared arena: the prefill worker
copies each layer into slots it claimed, the decode worker copies it out. What still took
milliseconds was learning that a layer was there: a Ray call to the store (`layer_written`),
then an item of the decode worker's store stream, ~1-6 ms each on the 2-core development
machine, and then the router's hand-off of the first token (the prefill call's return and the
decode worker's `generate` call, two more). Measured there on `bench transfer`'s model, the last
layer was in the arena ~1 ms after it was computed and the decode worker joined ~10 ms after.

Here a notice is one datagram on a Unix socket (`SOCK_SEQPACKET`: reliable, ordered, one
message per send) that the decode worker listens on in its event loop: "layer L of unit U of
request R is in these slots" (with the claim's lease, which the decode worker releases once it
has copied the unit's last layer), and "the first token of R is T", so the decode worker joins
its batch as soon as the last layer is in its pages, without waiting for the router.

When the prefill worker lends its own pages (the device tier, `engine/kv_cache.py`), it first
says who it is ("hello", its Ray actor name, once per connection; the decode worker opens its
KV cache from the export that actor gives), then before each layer's slots notice sends
"layer L of unit U is in these pages of mine". The decode worker copies from there, and answers
on the same connection "release R" once it needs none of R's pages any more (or at once, when
it cannot use them); the prefill worker holds them until then, or until the connection closes.

The socket has an abstract name (Linux: no file, so nothing is left behind when a worker is
killed); a connection from a process of another user is refused (its SO_PEERCRED uid);
messages are fixed binary records, checked field by field, never unpickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from halfmoon.kvstore.transfer.engine import EngineAddress
from halfmoon.kvstore.transfer.notice_format import (
    MAX_MESSAGE,
    Hello,
    Notice,
    NoticeError,
    ReleaseNotice,
    decode,
    encode,
)

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
TRY_LOCK_S = 0.002


@dataclass(frozen=True, slots=True)
class KvPeer:
    """Where a decode worker takes notices: its Ray node and its socket's abstract name
    (`path`, starting with a NUL byte); from other nodes, its transfer engine (`engine`,
    kvstore/transfer/engine.py; None: they send KV through the store)."""

    node_id: str
    path: str
    engine: EngineAddress | None = None

    def __str__(self) -> str:
        return "@" + self.path.lstrip("\0")  # as `ss -x` shows an abstract socket


def _receive_all(sock: socket.socket) -> tuple[list[bytes], bool]:
    """Every message waiting on the non-blocking `sock`, and whether its peer has gone."""
    messages = []
    while True:
        try:
            data = sock.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return messages, False
        except OSError:
            data = b""
        if not data:
            return messages, True
        messages.append(data)


class NoticeConn:
    """One prefill worker's connection to a listener: who it said it is (`lender`), what the
    decode worker opened from that (`cache`, its to set), and the way back (`reply`)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lender: str | None = None
        self.cache: object | None = None
        self.closed = False

    def reply(self, notice: ReleaseNotice) -> bool:
        """Send `notice` back to the prefill worker (never blocks); False when it cannot be
        (its worker is gone: its holds went with it)."""
        if self.closed:
            return False
        try:
            self.sock.send(encode(notice))
            return True
        except OSError as error:
            log.warning("cannot answer a KV notice sender: %s", error)
            return False


class NoticeListener:
    """A decode worker's socket, read in its event loop: each well-formed notice goes to
    `deliver(notice, conn)`; malformed ones are counted and dropped; `closed(conn)` is called
    when a sender's connection ends. Start it inside the running loop."""

    def __init__(
        self,
        node_id: str,
        deliver: Callable[[Notice, NoticeConn], None],
        closed: Callable[[NoticeConn], None] | None = None,
    ) -> None:
        self.deliver = deliver
        self.closed = closed
        self.num_malformed = 0
        self.num_refused = 0  # connections from another user's processes
        name = f"\0halfmoon-kv-notices-{os.getpid()}-{uuid.uuid4().hex}"
        self.peer = KvPeer(node_id, name)
        self._loop = asyncio.get_running_loop()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self.peer.path)
        self._server.listen(128)
        self._server.setblocking(False)
        self._conns: set[NoticeConn] = set()
        self._loop.add_reader(self._server.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            sock, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            self.num_refused += 1
            log.warning("refused a KV notice connection from uid %d", uid)
            sock.close()
            return
        sock.setblocking(False)
        conn = NoticeConn(sock)
        self._conns.add(conn)
        self._loop.add_reader(sock.fileno(), self._read, conn)

    def _read(self, conn: NoticeConn) -> None:
        messages, ended = _receive_all(conn.sock)
        for data in messages:
            try:
                notice = decode(data)
                if isinstance(notice, ReleaseNotice):
                    raise NoticeError("a release sent to a decode worker")
            except NoticeError as error:
                self.num_malformed += 1
                log.warning("dropped a malformed KV notice: %s", error)
                continue
            if isinstance(notice, Hello):
                conn.lender = notice.key
            self.deliver(notice, conn)
        if ended:  # the sender closed (or died)
            self._drop(conn)

    def _drop(self, conn: NoticeConn) -> None:
        self._loop.remove_reader(conn.sock.fileno())
        self._conns.discard(conn)
        conn.closed = True
        conn.sock.close()
        if self.closed is not None:
            self.closed(conn)

    def close(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        self._loop.remove_reader(self._server.fileno())
        self._server.close()


class NoticeSender:
    """A prefill worker's connections to decode workers' sockets, one per peer, kept open.
    `send` blocks (up to SEND_TIMEOUT_S), `try_send` never waits on the peer; both may be
    called from any thread (a lock keeps each message whole and in order).

    `hello`: this worker's Ray actor name, said first on each connection (it lends its pages).
    `replies`: called in `loop` with (peer, the `ReleaseNotice`) for each answer, and with
    (peer, None) when a connection ends (every hold for that peer may go)."""

    def __init__(
        self,
        hello: str | None = None,
        replies: Callable[[KvPeer, ReleaseNotice | None], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self.hello = hello
        self.replies = replies
        self.loop = loop
        self.num_sent = 0
        self.num_malformed_replies = 0

    def send(self, peer: KvPeer, notice: Notice) -> None:
        """Deliver `notice` (after those sent before it), reconnecting once if the connection
        broke; OSError when the peer cannot be reached (its worker died or restarted)."""
        payload = encode(notice)
        with self._lock:
            for attempt in (0, 1):
                conn = self._conns.get(peer.path)
                try:
                    if conn is None:
                        conn = self._connect(peer)
                    conn.send(payload)
                    self.num_sent += 1
                    return
                except OSError:
                    self._forget(peer.path)
                    if attempt:
                        raise

    def try_send(self, peer: KvPeer, notice: Notice) -> bool:
        """Deliver `notice` without waiting on the peer (from the engine's step thread): False
        when it would (no connection yet, a full or broken one, another thread's send taking
        over TRY_LOCK_S); then `send` it."""
        if not self._lock.acquire(timeout=TRY_LOCK_S):  # a send holds it for microseconds
            return False
        try:
            conn = self._conns.get(peer.path)
            if conn is None:
                return False
            # The descriptor is non-blocking underneath the socket's timeout, which `send`
            # would wait out: a plain write fails at once instead.
            os.write(conn.fileno(), encode(notice))
            self.num_sent += 1
            return True
        except OSError:
            return False
        finally:
            self._lock.release()

    def _connect(self, peer: KvPeer) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(SEND_TIMEOUT_S)
        try:
            conn.connect(peer.path)
            if self.hello is not None:
                conn.send(encode(Hello(self.hello)))
        except OSError:
            conn.close()
            raise
        self._conns[peer.path] = conn
        if self.replies is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self._watch, peer, conn)
        return conn

    def _watch(self, peer: KvPeer, conn: socket.socket) -> None:
        """In the loop: read the answers on `conn` until it ends, through a non-blocking
        duplicate of it (the publisher's sends wait up to SEND_TIMEOUT_S on the original)."""
        try:
            reader = conn.dup()
        except OSError:  # closed before the loop got to it
            self.replies(peer, None)
            return
        reader.setblocking(False)
        self.loop.add_reader(reader.fileno(), self._read, peer, reader)

    def _read(self, peer: KvPeer, conn: socket.socket) -> None:
        messages, ended = _receive_all(conn)
        for data in messages:
            try:
                notice = decode(data)
            except NoticeError as error:
                notice = error
            if not isinstance(notice, ReleaseNotice):
                self.num_malformed_replies += 1
                log.warning("dropped a malformed answer from a decode worker: %s", notice)
                continue
            self.replies(peer, notice)
        if ended:
            self.loop.remove_reader(conn.fileno())
            conn.close()
            self.replies(peer, None)

    def _forget(self, path: str) -> None:
        conn = self._conns.pop(path, None)
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # its reader in the loop then reads the end
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        with self._lock:
            for path in list(self._conns):
                self._forget(path)
