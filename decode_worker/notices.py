"""Notices handling: what prefill workers on this node tell the decode worker directly (each
layer's arena slots, each layer's lent pages, the first token; kvstore/transfer/channel.py), kept
on the receive they name (decode_worker/receives.py) until its copy-in takes it, and the claims
and lent pages given back."""

from __future__ import annotations

import asyncio
import logging

import ray

from halfmoon.decode_worker.receives import Receive, Receives
from halfmoon.engine.kv_cache import PagedKvCache
from halfmoon.kvstore.locate import local_store, local_store_name
from halfmoon.kvstore.transfer.channel import KvPeer, NoticeConn, NoticeListener
from halfmoon.kvstore.transfer.notice_format import (
    Hello,
    LayerNotice,
    Notice,
    PagesNotice,
    ReleaseNotice,
    TokenNotice,
)

log = logging.getLogger(__name__)
# A prefill worker's notices can overtake the reserve they belong to (both are sent at once):
# they wait this long for it, then their claims go back to the store.
EARLY_NOTICE_S = 30.0


class Notices:
    """The decode worker's notice socket; what comes on it goes to the receive it names."""

    def __init__(
        self,
        kv_cache: PagedKvCache,
        receives: Receives,
        store=None,
        early_notice_s: float = EARLY_NOTICE_S,
    ) -> None:
        self.kv_cache = kv_cache  # the engine's: lenders' caches are opened against it
        self.receives = receives
        self.early_notice_s = early_notice_s
        self.listener: NoticeListener | None = None
        # Connections whose lender's cache is being opened: their page notices wait for it.
        self.opening: dict[NoticeConn, asyncio.Future] = {}
        self.node_store = store  # this node's store, where notices' claims are released
        self.num_lenders = 0  # prefill workers' caches opened
        self.num_notices = 0  # notices received from prefill workers

    def counters(self) -> dict:
        return {
            "num_lenders": self.num_lenders,
            "num_notices": self.num_notices,
            "num_malformed_notices": self.listener.num_malformed if self.listener else 0,
        }

    def peer(self) -> KvPeer:
        """Where prefill workers on this node send their notices (opened on first call)."""
        if self.listener is None:
            node = ray.get_runtime_context().get_node_id()
            self.listener = NoticeListener(node, self._on_notice, self._on_closed)
        return self.listener.peer

    @property
    def listening(self) -> bool:
        """Prefill workers on this node can tell this worker directly (`peer` was asked)."""
        return self.listener is not None

    def adopt(self, receive: Receive) -> None:
        """A new receive: the notices that came for it before its reserve are its now."""
        early, receive.early = receive.early, []
        for notice, conn in early:
            self._on_notice(notice, conn)

    def abort(self, request_id: str, ticket: str | None) -> None:
        """Attempt `ticket` is aborted: its reserve, if it lands later, is refused, so the
        notices that came before it are given back now."""
        self._give_back(ticket, self.receives.abort(request_id, ticket))

    def undirect(self, receive: Receive) -> None:
        """Take no more of the notices' arena slots or lent pages for this receive (when it
        ends, callers wait for the copies already issued to land first)."""
        self.release([n.lease for n in receive.layers.values()])
        receive.layers.clear()
        self.answer_lenders(receive)

    def answer_lenders(self, receive: Receive) -> None:
        """Tell each prefill worker that lent this receive pages that it needs none any more
        (the copies out of them have landed: callers wait for the writes first)."""
        conns = receive.lenders | {conn for _, conn in receive.pages.values()}
        receive.pages.clear()
        receive.lenders.clear()
        for conn in conns:
            self.refuse(receive, conn)

    def _on_notice(self, notice: Notice, conn: NoticeConn) -> None:
        """A notice from a prefill worker (the listener's callback, in the event loop)."""
        self.num_notices += 1
        if isinstance(notice, Hello):
            self.opening[conn] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._open_lender(conn))
            return
        receive = self.receives.live(notice.key)
        if receive is None:
            self._on_unknown(notice, conn)
        elif isinstance(notice, TokenNotice):
            receive.give_first_token(notice.token_id)
        elif isinstance(notice, PagesNotice):
            self._on_pages(receive, notice, conn)
        elif not receive.direct or (notice.unit, notice.layer) in receive.copied:
            self.release([notice.lease])  # through the store stream, or copied already
        else:
            receive.layers[(notice.unit, notice.layer)] = notice
            receive.arrived.set()

    def _on_unknown(self, notice: Notice, conn: NoticeConn) -> None:
        """A notice for no receive: of one that ended (given back), or one to come."""
        if self.receives.ended(notice.key) is not None:  # it ended: nothing will copy it
            self.release([notice.lease] if isinstance(notice, LayerNotice) else [])
            if isinstance(notice, PagesNotice):
                conn.reply(ReleaseNotice(notice.key))
            return
        if self.receives.hold_early(notice.key, notice, conn):
            asyncio.get_running_loop().call_later(self.early_notice_s, self._drop_early, notice.key)

    def _on_pages(self, receive: Receive, notice: PagesNotice, conn: NoticeConn) -> None:
        opened = conn.cache is not None or conn in self.opening  # or soon will be
        if not (receive.direct and opened and not conn.closed):
            self.refuse(receive, conn)
            return
        if conn in receive.refused:
            return
        receive.lenders.add(conn)
        receive.pages[(notice.unit, notice.layer)] = (notice, conn)
        receive.arrived.set()

    def refuse(self, receive: Receive, conn: NoticeConn) -> None:
        """Take none of `conn`'s lent pages for this receive (the arena's copies instead):
        told once, for all of them, so the lender may give them back at once."""
        if conn not in receive.refused:
            receive.refused.add(conn)
            conn.reply(ReleaseNotice(receive.key))

    def _drop_early(self, key: str) -> None:
        """Notices whose reserve never came: give their claims and lent pages back."""
        self._give_back(key, self.receives.drop_early(key))

    def _give_back(self, key: str, early: list[tuple[Notice, NoticeConn]]) -> None:
        self.release([n.lease for n, _ in early if isinstance(n, LayerNotice)])
        for conn in {conn for n, conn in early if isinstance(n, PagesNotice)}:
            conn.reply(ReleaseNotice(key))

    def _on_closed(self, conn: NoticeConn) -> None:
        """A prefill worker's connection ended: the pages it lent are not held any more, so a
        receive still copying from them fails (the router retries it), and its cache is
        closed once the copies already queued from it have landed."""
        for receive in self.receives:
            if conn in receive.lenders and not receive.lender_lost:
                receive.lender_lost = True
                receive.arrived.set()
        if conn.cache is not None:
            asyncio.get_running_loop().create_task(self._close_lender(conn))

    async def _close_lender(self, conn: NoticeConn) -> None:
        """Drop a gone lender's cache (its CUDA IPC mappings): no copy is issued from it any
        more (`next_offer` refuses a conn without a cache), the queued ones land first."""
        cache, conn.cache = conn.cache, None
        await asyncio.to_thread(self.kv_cache.close_peer, cache)
        log.info("closed the KV cache of %s (its connection ended)", conn.lender)

    async def _open_lender(self, conn: NoticeConn) -> None:
        """Open the KV cache of the prefill worker that said hello on `conn`, so its page
        notices can be copied from; until then (or if it cannot be) they are refused and its
        layers come through the arena."""
        try:
            lender = ray.get_actor(conn.lender)
            export = await lender.kv_export.remote()
            if export is None:
                raise ValueError("it does not lend its pages")
            conn.cache = self.kv_cache.open_peer(export)
            self.num_lenders += 1
            log.info("copying KV straight out of the pages of %s", conn.lender)
        except Exception as error:  # noqa: BLE001 - the arena path stays; say why once
            log.warning("cannot open the KV cache of %s: %s", conn.lender, error)
        finally:
            self.opening.pop(conn).set_result(conn.cache is not None)

    async def next_offer(
        self, receive: Receive, where: tuple[int, int]
    ) -> tuple[tuple[PagesNotice, NoticeConn] | None, LayerNotice | None]:
        """Wait for layer `where` (unit, layer) to be offered: in a lender's pages that can be
        copied from (waiting for its cache to open), else in arena slots."""
        while True:
            if receive.lender_lost:
                raise ConnectionError("the prefill worker lending this request's pages went away")
            lent = receive.pages.pop(where, None)
            if lent is not None:
                conn = lent[1]
                if conn in receive.refused:
                    continue  # told its lender we take none of its pages
                if conn.cache is None and (opening := self.opening.get(conn)) is not None:
                    await asyncio.shield(opening)  # its lender's cache opens
                if conn.cache is not None:
                    return lent, None
                self.refuse(receive, conn)  # it could not be opened: the arena's copy
                continue
            if (notice := receive.layers.pop(where, None)) is not None:
                return None, notice
            receive.arrived.clear()
            await receive.arrived.wait()

    def forget_store(self, name: str) -> None:
        """Store node `name` was replaced: this node's is looked up afresh on next use."""
        if name == local_store_name():
            self.node_store = None

    def release(self, leases: list[int]) -> None:
        """Give claims back to this node's store (which the prefill worker's notices name);
        its handle is looked up once (a lookup asks Ray's GCS, ~1 ms, in the event loop)."""
        leases = [lease for lease in leases if lease]
        if not leases:
            return
        if self.node_store is None:
            self.node_store = local_store()
        self.node_store.release_many.remote(leases)
