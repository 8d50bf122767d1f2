"""Notices from a prefill worker to a decode worker: the binary format, checked field by field,
and delivery over a real Unix socket into an asyncio loop."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import pytest

from halfmoon.kvstore.transfer.channel import KvPeer, NoticeListener, NoticeSender
from halfmoon.kvstore.transfer.notice_format import (
    MAX_KEY_BYTES,
    MAX_SLOTS,
    Hello,
    LayerNotice,
    NoticeError,
    PagesNotice,
    ReleaseNotice,
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
    for notice in (
        PagesNotice("ticket-1", unit=2, layer=15, pages=(7, 3, 2**32 - 1)),
        Hello("halfmoon-abc-prefill-0"),
        ReleaseNotice("ticket-1"),
    ):
        assert decode(encode(notice)) == notice


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
        (encode(PagesNotice("k", 0, 1, (1, 2)))[:-2], "2 pages with 16 bytes"),
        (struct.pack("<4sBH", b"HMKN", 4, 1) + b"k" + b"\0" * 9, "pages notice with 9 bytes"),
        (encode(Hello("me")) + b"x", "hello with a body"),
        (encode(ReleaseNotice("r")) + b"x", "release with a body"),
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
    with pytest.raises(NoticeError, match="pages in one notice"):
        encode(PagesNotice("k", 0, 0, tuple(range(MAX_SLOTS + 1))))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_notices_arrive_in_order_and_malformed_ones_are_dropped():
    async def scenario():
        got = []
        listener = NoticeListener("node-a", lambda notice, conn: got.append(notice))
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
        listener = NoticeListener("node-a", lambda notice, conn: got.append(notice))
        sender = NoticeSender()
        await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 1))
        await _until(lambda: len(got) == 1)
        # The peer's connection broke (the worker's listener closed it): the next send
        # reconnects to the same socket and arrives.
        for conn in list(listener._conns):
            listener._drop(conn)
        await _until(lambda: not listener._conns)
        await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 2))
        await _until(lambda: len(got) == 2)
        listener.close()
        with pytest.raises(OSError):  # the worker is gone: the publisher learns it at once
            await asyncio.to_thread(sender.send, listener.peer, TokenNotice("a", 3))
        sender.close()

    asyncio.run(scenario())


def test_a_lender_says_hello_first_and_hears_releases_and_the_end_of_the_connection():
    async def scenario():
        got, conns, ended, answers = [], [], [], []
        listener = NoticeListener(
            "node-a",
            lambda notice, conn: (got.append(notice), conns.append(conn)),
            ended.append,
        )
        loop = asyncio.get_running_loop()
        sender = NoticeSender("prefill-7", lambda peer, answer: answers.append(answer), loop)
        pages = PagesNotice("r", 0, 0, (4, 5))
        await asyncio.to_thread(sender.send, listener.peer, pages)
        await _until(lambda: len(got) == 2)
        assert got == [Hello("prefill-7"), pages]
        conn = conns[0]
        assert conn.lender == "prefill-7" and conns[1] is conn
        assert conn.reply(ReleaseNotice("r"))
        await _until(lambda: answers == [ReleaseNotice("r")])
        conn.sock.send(encode(TokenNotice("r", 1)))  # not an answer: dropped
        await _until(lambda: sender.num_malformed_replies == 1)
        listener.close()  # the decode worker went away: every hold for it may go
        await _until(lambda: answers == [ReleaseNotice("r"), None])
        assert ended == [conn] and conn.closed and not conn.reply(ReleaseNotice("r"))
        # a release sent to a decode worker is malformed there
        listener = NoticeListener("node-a", lambda notice, conn: got.append(notice))
        await asyncio.to_thread(sender.send, listener.peer, ReleaseNotice("r"))
        await _until(lambda: listener.num_malformed == 1)
        assert got[-1] == Hello("prefill-7")
        sender.close()
        listener.close()

    asyncio.run(scenario())


def test_try_send_never_waits_on_a_peer_that_is_not_reading():
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind("\0halfmoon-test-full-" + os.urandom(6).hex())
    server.listen(1)
    peer = KvPeer("node-a", server.getsockname())
    sender = NoticeSender()
    notice = PagesNotice("r", 0, 0, tuple(range(1000)))
    assert not sender.try_send(peer, notice)  # no connection yet: that is `send`'s job
    sender.send(peer, notice)
    started = time.monotonic()
    sent = 0
    while sender.try_send(peer, notice):  # nobody reads: the socket's buffer fills up
        sent += 1
        assert sent < 100_000
    assert sent > 0 and time.monotonic() - started < 1.0  # refused at once, never waited
    sender.close()
    server.close()


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
        listener = NoticeListener("node-a", lambda notice, conn: got.append(notice))
        pid = stranger(listener.peer.path)
        await _until(lambda: listener.num_refused == 1)
        await asyncio.to_thread(os.waitpid, pid, 0)
        assert got == []
        listener.close()

    asyncio.run(scenario())
