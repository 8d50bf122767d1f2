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

log = logging.getLogger(__name__)

MAGIC = b"HMKN"
LAYER, FIRST_TOKEN = 1, 2
_HEAD = struct.Struct("<4sBH")  # magic, kind, length of the receive key
_LAYER = struct.Struct("<IHQI")  # unit, layer, lease to release (0: none), number of slots
_TOKEN = struct.Struct("<q")
MAX_KEY_BYTES = 512
MAX_SLOTS = 4096  # a unit of 64k tokens in 16-token blocks; one message stays under 17 KiB
MAX_MESSAGE = _HEAD.size + MAX_KEY_BYTES + _LAYER.size + 4 * MAX_SLOTS
SEND_TIMEOUT_S = 5.0


class NoticeError(ValueError):
    """A message that is not a well-formed notice."""


@dataclass(frozen=True, slots=True)
class KvPeer:
    """Where a decode worker takes notices: its Ray node and its socket's abstract name
    (`path`, starting with a NUL byte)."""

    node_id: str
    path: str

    def __str__(self) -> str:
        return "@" + self.path.lstrip("\0")  # as `ss -x` shows an abstract socket


@dataclass(frozen=True, slots=True)
class LayerNotice:
    """Layer `layer` of transfer unit `unit` of the receive `key` is in arena `slots`; the
    claim `lease` (0: none) is the reader's to release once it has copied the unit."""

    key: str
    unit: int
    layer: int
    lease: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenNotice:
    """The first token of the receive `key`, sampled by its prefill."""

    key: str
    token_id: int


Notice = LayerNotice | TokenNotice


def encode(notice: Notice) -> bytes:
    key = notice.key.encode()
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise NoticeError(f"receive key of {len(key)} bytes (1 to {MAX_KEY_BYTES})")
    if isinstance(notice, TokenNotice):
        return _HEAD.pack(MAGIC, FIRST_TOKEN, len(key)) + key + _TOKEN.pack(notice.token_id)
    if len(notice.slots) > MAX_SLOTS:
        raise NoticeError(f"{len(notice.slots)} slots in one notice (at most {MAX_SLOTS})")
    body = _LAYER.pack(notice.unit, notice.layer, notice.lease, len(notice.slots))
    slots = struct.pack(f"<{len(notice.slots)}I", *notice.slots)
    return _HEAD.pack(MAGIC, LAYER, len(key)) + key + body + slots


def decode(data: bytes) -> Notice:
    """The notice in `data`, or NoticeError saying what is wrong with it."""
    if len(data) < _HEAD.size:
        raise NoticeError(f"{len(data)} bytes: shorter than a header")
    magic, kind, key_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise NoticeError(f"magic {magic!r}, not {MAGIC!r}")
    if not 0 < key_len <= MAX_KEY_BYTES or len(data) < _HEAD.size + key_len:
        raise NoticeError(f"receive key of {key_len} bytes in a {len(data)}-byte message")
    try:
        key = data[_HEAD.size : _HEAD.size + key_len].decode()
    except UnicodeDecodeError as error:
        raise NoticeError(f"receive key is not UTF-8: {error}") from None
    rest = memoryview(data)[_HEAD.size + key_len :]
    if kind == FIRST_TOKEN:
        if len(rest) != _TOKEN.size:
            raise NoticeError(f"first-token notice with {len(rest)} bytes of body")
        (token_id,) = _TOKEN.unpack(rest)
        return TokenNotice(key, token_id)
    if kind != LAYER:
        raise NoticeError(f"unknown notice kind {kind}")
    if len(rest) < _LAYER.size:
        raise NoticeError(f"layer notice with {len(rest)} bytes of body")
    unit, layer, lease, num_slots = _LAYER.unpack_from(rest)
    if len(rest) != _LAYER.size + 4 * num_slots or num_slots > MAX_SLOTS:
        raise NoticeError(f"layer notice of {num_slots} slots with {len(rest)} bytes of body")
    slots = struct.unpack_from(f"<{num_slots}I", rest, _LAYER.size)
    return LayerNotice(key, unit, layer, lease, slots)


class NoticeListener:
    """A decode worker's socket, read in its event loop: each well-formed notice goes to
    `deliver`; malformed ones are counted and dropped. Start it inside the running loop."""

    def __init__(self, node_id: str, deliver: Callable[[Notice], None]) -> None:
        self.deliver = deliver
        self.num_malformed = 0
        self.num_refused = 0  # connections from another user's processes
        name = f"\0halfmoon-kv-notices-{os.getpid()}-{uuid.uuid4().hex}"
        self.peer = KvPeer(node_id, name)
        self._loop = asyncio.get_running_loop()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self.peer.path)
        self._server.listen(128)
        self._server.setblocking(False)
        self._conns: set[socket.socket] = set()
        self._loop.add_reader(self._server.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            self.num_refused += 1
            log.warning("refused a KV notice connection from uid %d", uid)
            conn.close()
            return
        conn.setblocking(False)
        self._conns.add(conn)
        self._loop.add_reader(conn.fileno(), self._read, conn)

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                data = conn.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the sender closed (or died)
                self._drop(conn)
                return
            try:
                notice = decode(data)
            except NoticeError as error:
                self.num_malformed += 1
                log.warning("dropped a malformed KV notice: %s", error)
                continue
            self.deliver(notice)

    def _drop(self, conn: socket.socket) -> None:
        self._loop.remove_reader(conn.fileno())
        self._conns.discard(conn)
        conn.close()

    def close(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        self._loop.remove_reader(self._server.fileno())
        self._server.close()


class NoticeSender:
    """A prefill worker's connections to decode workers' sockets, one per peer, kept open.
    `send` blocks (up to SEND_TIMEOUT_S); call it from one thread (the publisher)."""

    def __init__(self) -> None:
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self.num_sent = 0

    def send(self, peer: KvPeer, notice: Notice) -> None:
        """Deliver `notice` (after those sent before it), reconnecting once if the connection
        broke; OSError when the peer cannot be reached (its worker died or restarted)."""
        payload = encode(notice)
        with self._lock:
            for attempt in (0, 1):
                conn = self._conns.get(peer.path)
                try:
                    if conn is None:
                        conn = self._connect(peer.path)
                    conn.send(payload)
                    self.num_sent += 1
                    return
                except OSError:
                    self._forget(peer.path)
                    if attempt:
                        raise

    def _connect(self, path: str) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(SEND_TIMEOUT_S)
        try:
            conn.connect(path)
        except OSError:
            conn.close()
            raise
        self._conns[path] = conn
        return conn

    def _forget(self, path: str) -> None:
        conn = self._conns.pop(path, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        with self._lock:
            for path in list(self._conns):
                self._forget(path)
