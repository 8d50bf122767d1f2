"""Notices from a prefill worker to a decode worker: the binary format, checked field by field,
and delivery over a real Unix socket into an asyncio loop."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest

from halfmoon.kvstore.kv_notices import (
    MAX_KEY_BYTES,
    MAX_SLOTS,
    LayerNotice,
    NoticeError,
    NoticeListener,
    NoticeSender,
    TokenNotice,
    decode,
    encode,
)

LAYER = LayerNotice("ticket-1", unit=3, layer=7, lease=2**40 + 5, slots=(9, 10, 11, 4))


def test_notices_round_trip():
    assert decode(encode(LAYER)) == LAYER
    token = TokenNotice("réquest-ü", token_id=-1)
    assert decode(encode(token)) == token
    empty = LayerNotice("k", 0, 0, 0, ())
    assert decode(encode(empty)) == empty


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "shorter than a header"),
        (b"XXXX" + encode(LAYER)[4:], "magic"),
        (encode(LAYER)[:4] + bytes([9]) + encode(LAYER)[5:], "unknown notice kind 9"),
        (encode(LAYER)[:-1], "4 slots with 33 bytes"),
        (encode(LAYER) + b"\0\0\0\0", "4 slots with 38 bytes"),
        (encode(TokenNotice("k", 5))[:-1], "first-token notice with 7 bytes"),
        (struct.pack("<4sBH", b"HMKN", 2, 0) + b"\0" * 8, "receive key of 0 bytes"),
        (struct.pack("<4sBH", b"HMKN", 2, 600) + b"a" * 600, "receive key of 600 bytes"),
        (struct.pack("<4sBH", b"HMKN", 2, 2) + b"\xff\xfe" + b"\0" * 8, "not UTF-8"),
        (struct.pack("<4sBH", b"HMKN", 1, 1) + b"k" + b"\0" * 5, "layer notice with 5 bytes"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_malformed_messages_say_what_is_wrong(data, why):
    with pytest.raises(NoticeError, match=why):
        decode(data)


def test_encode_refuses_what_decode_would():
    with pytest.raises(NoticeError, match="receive key"):
        encode(TokenNotice("x" * (MAX_KEY_BYTES + 1), 1))
    with pytest.raises(NoticeError, match="slots in one notice"):
        encode(LayerNotice("k", 0, 0, 0, tuple(range(MAX_SLOTS + 1))))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_notices_arrive_in_order_and_malformed_ones_are_dropped():
    async def scenario():
        got = []
        listener = NoticeListener("node-a", got.append)
        try:
            assert listener.peer.node_id == "node-a" and listener.peer.path.startswith("\0")
            sender = NoticeSender()
            notices = [LayerNotice("r", 0, layer, 0, (layer,)) for layer in range(50)]
            notices.append(TokenNotice("r", 42))
            # The publisher thread blocks on its sends; the loop keeps reading meanwhile.
            await asyncio.to_thread(lambda: [sender.send(listener.peer, n) for n in notices[:25]])
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            raw.connect(listener.peer.path)
            raw.send(b"not a notice")
            raw.send(encode(TokenNotice("other", 1)))
            await asyncio.to_thread(lambda: [sender.send(listener.peer, n) for n in notices[25:]])
            await _until(lambda: len(got) == len(notices) + 1)
            assert [n for n in got if n.key == "r"] == notices  # in order, none lost
            assert TokenNotice("other", 1) in got and listener.num_malformed == 1
            assert sender.num_sent == len(notices)
            raw.close()
            sender.close()
        finally:
            listener.close()

    asyncio.run(scenario())


def test_a_sender_reconnects_once_and_reports_a_peer_that_is_gone():
    async def scenario():
        got = []
        listener = NoticeListener("node-a", got.append)
        sender = NoticeSender()
        await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 1))
        await _until(lambda: len(got) == 1)
        # The peer's connection broke (the worker's listener closed it): the next send
        # reconnects to the same socket and arrives.
        for conn in list(listener._conns):
            listener._drop(conn)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 2))
        await _until(lambda: len(got) == 2)
        listener.close()
        with pytest.raises(OSError):  # the worker is gone: the publisher learns it at once
            await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 3))
        sender.close()

    asyncio.run(scenario())


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another user needs root")
def test_a_process_of_another_user_is_refused():
    """Abstract sockets have no file permissions: the listener checks the peer's uid."""

    def stranger(name: str) -> int:  # a child process that becomes `nobody` and connects
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(65534)
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                conn.connect(name)
                conn.send(encode(TokenNotice("r", 1)))
                conn.recv(1)  # returns once the listener closes the connection
            finally:
                os._exit(0)
        return pid

    async def scenario():
        got = []
        listener = NoticeListener("node-a", got.append)
        pid = stranger(listener.peer.path)
        await _until(lambda: listener.num_refused == 1)
        await asyncio.to_thread(os.waitpid, pid, 0)
        assert got == []
        listener.close()

    asyncio.run(scenario())
