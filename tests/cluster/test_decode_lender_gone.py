"""A prefill worker whose notice connection ends (it died) while it lent pages: the receives
copying from it fail at once, and its cache is closed, its CUDA IPC mappings dropped, only
after the copies already queued from it have landed (no Ray here: the notices on their own)."""

from __future__ import annotations

import asyncio

from halfmoon.decode_worker.notices import Notices
from halfmoon.decode_worker.receives import Receives
from halfmoon.kvstore.transfer.channel import NoticeConn


class FakeKv:
    """The engine's KV cache as the notices see it: records what it was asked to close."""

    def __init__(self, order: list[str]) -> None:
        self.order = order

    def close_peer(self, cache) -> None:
        self.order.append(f"close {cache}")


def test_a_gone_lender_fails_its_receives_and_its_cache_is_closed_after_its_copies():
    async def scenario() -> tuple[list[str], object, bool]:
        order: list[str] = []
        receives = Receives()
        notices = Notices(FakeKv(order), receives)
        conn = NoticeConn(None)
        conn.lender, conn.cache = "prefill-0", "lent-cache"
        receive = receives.open("r1", "key-1", num_tokens=16, direct=False)
        receive.lenders.add(conn)
        conn.closed = True
        notices._on_closed(conn)
        lost = receive.lender_lost  # at once, before the close runs
        order.append("callback returned")
        closing = asyncio.all_tasks() - {asyncio.current_task()}
        await asyncio.gather(*closing)  # the close, which waits in a worker thread
        return order, conn.cache, lost

    order, cache, lost = asyncio.run(scenario())
    assert lost and cache is None
    assert order == ["callback returned", "close lent-cache"]
