"""Notices handling: what prefill workers on this node tell the decode worker directly (each
layer's arena slots, each layer's lent pages, the first token; kvstore/transfer/channel.py), kept
per reservation until the receive takes it, and the claims and lent pages given back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict

import ray

from halfmoon.engine.errors import HalfmoonError
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
# they wait this long for it, then their claims go back to the store. Keys of receives that
# ended are remembered (up to RECENT_KEYS) so their late notices are released at once.
EARLY_NOTICE_S = 30.0
RECENT_KEYS = 4096


@dataclasses.dataclass(slots=True)
class Reservation:
    """One reserved request: what the prefill worker's notices call it, its first token (from
    the reserve of a retry, the prefill worker's notice, or `generate`, whichever comes
    first; a list, one per sequence, when `n` > 1: no notice carries those), and, when the
    prefill worker tells this worker directly, the layers it said are in the arena and the
    claims this worker owes the store a release of; when the prefill worker lends its own
    pages, the layers it said are in them, and the connections this worker owes a
    `ReleaseNotice` (`lenders`) or has refused (`refused`: their later page notices are
    refused too, as the prefill worker may have taken the pages back)."""

    key: str
    first_token: asyncio.Future
    direct: bool = False
    layers: dict[tuple[int, int], LayerNotice] = dataclasses.field(default_factory=dict)
    pages: dict[tuple[int, int], tuple[PagesNotice, NoticeConn]] = dataclasses.field(
        default_factory=dict
    )
    copied: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # out of lent pages
    lenders: set[NoticeConn] = dataclasses.field(default_factory=set)
    refused: set[NoticeConn] = dataclasses.field(default_factory=set)
    lender_lost: bool = False
    # On CUDA, an event after the last readers of the reserved pages (`PagedKvCache.mark`):
    # writes into them wait for it, not for every step queued since.
    fence: object | None = None
    arrived: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    join_error: HalfmoonError | None = None
    # From a prefill worker on another node (decode_worker/engine_receive.py): its word, a
    # staging `Grant` or None (the store's stream), and the (unit, layer)s that landed.
    num_tokens: int = 0
    engine: asyncio.Future | None = None
    landed: set[tuple[int, int]] = dataclasses.field(default_factory=set)


class Notices:
    """The decode worker's notice socket and the reservations its notices are for."""

    def __init__(
        self, kv_cache: PagedKvCache, store=None, early_notice_s: float = EARLY_NOTICE_S
    ) -> None:
        self.kv_cache = kv_cache  # the engine's: lenders' caches are opened against it
        self.early_notice_s = early_notice_s
        self.listener: NoticeListener | None = None
        self.reservations: dict[str, Reservation] = {}  # by request id
        self.by_key: dict[str, Reservation] = {}  # by the key notices name them by
        # Notices that overtook their reserve, with the connection each came on.
        self.early: dict[str, list[tuple[Notice, NoticeConn]]] = {}
        self.ended_keys: OrderedDict[str, None] = OrderedDict()
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

    def add(
        self, request_id: str, key: str, direct: bool, first_token_id: int | list[int] | None
    ) -> Reservation:
        """A new reservation, given the notices that came for it before it."""
        reservation = Reservation(key, asyncio.get_running_loop().create_future())
        reservation.direct = direct and self.listener is not None
        if first_token_id is not None:
            reservation.first_token.set_result(first_token_id)
        self.reservations[request_id] = self.by_key[key] = reservation
        for notice, conn in self.early.pop(key, []):
            self._on_notice(notice, conn)
        return reservation

    def find(self, key: str) -> Reservation | None:
        """The live reservation that notices call `key`, if any."""
        return self.by_key.get(key)

    def reservation(self, request_id: str) -> Reservation:
        """The reservation of `request_id` (KeyError if it has none)."""
        return self.reservations[request_id]

    def key_of(self, request_id: str) -> str | None:
        """The key (ticket or request id) of the reservation of `request_id`, if it has one."""
        reservation = self.reservations.get(request_id)
        return None if reservation is None else reservation.key

    def forget(self, request_id: str) -> None:
        """The reservation's notices are not needed any more: later ones are released."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is None:
            return
        if self.by_key.get(reservation.key) is reservation:
            del self.by_key[reservation.key]
        self.ended_keys[reservation.key] = None
        while len(self.ended_keys) > RECENT_KEYS:
            self.ended_keys.popitem(last=False)
        reservation.first_token.cancel()  # no-op once known; else nothing will bring it now
        self.undirect(reservation)

    def undirect(self, reservation: Reservation) -> None:
        """Take no more of the notices' arena slots or lent pages for this receive."""
        self.release([n.lease for n in reservation.layers.values()])
        reservation.layers.clear()
        self.answer_lenders(reservation)

    def answer_lenders(self, reservation: Reservation) -> None:
        """Tell each prefill worker that lent this receive pages that it needs none any more
        (the copies out of them have landed: callers wait for the writes first)."""
        conns = reservation.lenders | {conn for _, conn in reservation.pages.values()}
        reservation.pages.clear()
        reservation.lenders.clear()
        for conn in conns:
            self.refuse(reservation, conn)

    def _on_notice(self, notice: Notice, conn: NoticeConn) -> None:
        """A notice from a prefill worker (the listener's callback, in the event loop)."""
        self.num_notices += 1
        if isinstance(notice, Hello):
            self.opening[conn] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._open_lender(conn))
            return
        reservation = self.by_key.get(notice.key)
        if reservation is None:
            self._on_unknown(notice, conn)
        elif isinstance(notice, TokenNotice):
            if not reservation.first_token.done():
                reservation.first_token.set_result(notice.token_id)
        elif isinstance(notice, PagesNotice):
            self._on_pages(reservation, notice, conn)
        elif not reservation.direct or (notice.unit, notice.layer) in reservation.copied:
            self.release([notice.lease])  # through the store stream, or copied already
        else:
            reservation.layers[(notice.unit, notice.layer)] = notice
            reservation.arrived.set()

    def _on_unknown(self, notice: Notice, conn: NoticeConn) -> None:
        """A notice for no reservation: of one that ended (given back), or one to come."""
        if notice.key in self.ended_keys:  # its receive ended: nothing will copy it
            self.release([notice.lease] if isinstance(notice, LayerNotice) else [])
            if isinstance(notice, PagesNotice):
                conn.reply(ReleaseNotice(notice.key))
            return
        if notice.key not in self.early:
            asyncio.get_running_loop().call_later(self.early_notice_s, self._drop_early, notice.key)
        self.early.setdefault(notice.key, []).append((notice, conn))

    def _on_pages(self, reservation: Reservation, notice: PagesNotice, conn: NoticeConn) -> None:
        opened = conn.cache is not None or conn in self.opening  # or soon will be
        if not (reservation.direct and opened and not conn.closed):
            self.refuse(reservation, conn)
            return
        if conn in reservation.refused:
            return
        reservation.lenders.add(conn)
        reservation.pages[(notice.unit, notice.layer)] = (notice, conn)
        reservation.arrived.set()

    def refuse(self, reservation: Reservation, conn: NoticeConn) -> None:
        """Take none of `conn`'s lent pages for this receive (the arena's copies instead):
        told once, for all of them, so the lender may give them back at once."""
        if conn not in reservation.refused:
            reservation.refused.add(conn)
            conn.reply(ReleaseNotice(reservation.key))

    def _drop_early(self, key: str) -> None:
        """Notices whose reserve never came: give their claims and lent pages back."""
        early = self.early.pop(key, [])
        self.release([n.lease for n, _ in early if isinstance(n, LayerNotice)])
        for conn in {conn for n, conn in early if isinstance(n, PagesNotice)}:
            conn.reply(ReleaseNotice(key))

    def _on_closed(self, conn: NoticeConn) -> None:
        """A prefill worker's connection ended: the pages it lent are not held any more, so a
        receive still copying from them fails (the router retries it), and its cache is
        closed once the copies already queued from it have landed."""
        for reservation in self.reservations.values():
            if conn in reservation.lenders and not reservation.lender_lost:
                reservation.lender_lost = True
                reservation.arrived.set()
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
        self, reservation: Reservation, where: tuple[int, int]
    ) -> tuple[tuple[PagesNotice, NoticeConn] | None, LayerNotice | None]:
        """Wait for layer `where` (unit, layer) to be offered: in a lender's pages that can be
        copied from (waiting for its cache to open), else in arena slots."""
        while True:
            if reservation.lender_lost:
                raise ConnectionError("the prefill worker lending this request's pages went away")
            lent = reservation.pages.pop(where, None)
            if lent is not None:
                conn = lent[1]
                if conn in reservation.refused:
                    continue  # told its lender we take none of its pages
                if conn.cache is None and (opening := self.opening.get(conn)) is not None:
                    await asyncio.shield(opening)  # its lender's cache opens
                if conn.cache is not None:
                    return lent, None
                self.refuse(reservation, conn)  # it could not be opened: the arena's copy
                continue
            if (notice := reservation.layers.pop(where, None)) is not None:
                return None, notice
            reservation.arrived.clear()
            await reservation.arrived.wait()

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
