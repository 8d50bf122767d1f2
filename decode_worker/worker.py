"""The decode worker: reserves pages, pulls each layer of a prompt's KV from the store as it
lands (or, on the prefill worker's node, copies it out of the prefill worker's own pages or
the store's shared arena when the prefill worker says it is there), joins the request to its
continuous batch as soon as the last layer and the first token are in, and streams the tokens
back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

import ray

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import LLMEngine, RequestOutput
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.worker_base import EngineWorker
from halfmoon.engine.worker_errors import WorkerError, aborted
from halfmoon.kvstore.kv_notices import (
    Hello,
    KvPeer,
    LayerNotice,
    Notice,
    NoticeConn,
    NoticeListener,
    PagesNotice,
    ReleaseNotice,
    TokenNotice,
)
from halfmoon.kvstore.locate import local_store
from halfmoon.kvstore.shared_arena import MappedArena, map_arena
from halfmoon.kvstore.transfer import plan_transfer

log = logging.getLogger(__name__)
RECENT_TIMINGS = 1024
# Until the router hands the request over (its prefill returned), the reads wait for the
# prefill however long it queues and computes, up to this bound: the router aborts the
# reservation when the prefill fails or its worker dies. After the hand-off, what is still
# missing must land within `get_timeout_s`.
PREFILL_WAIT_S = 3600.0
# A reservation whose KV has landed (or whose receive failed) and that no `generate` claims
# within this many seconds is freed: the router that made it died or lost track of it. The
# router hands over as soon as its prefill returns, a moment before its last layers land.
HANDOFF_TIMEOUT_S = 60.0
# Ids of reservations freed that way, kept so a late `generate` says why it finds none.
EXPIRED_IDS = 1024
# A prefill worker's notices can overtake the reserve they belong to (both are sent at once):
# they wait this long for it, then their claims go back to the store. Keys of receives that
# ended are remembered (up to RECENT_KEYS) so their late notices are released at once.
EARLY_NOTICE_S = 30.0
RECENT_KEYS = 4096


@dataclasses.dataclass(slots=True)
class _Reservation:
    """One reserved request: what the prefill worker's notices call it, its first token (from
    the reserve of a retry, the prefill worker's notice, or `generate`, whichever comes
    first), and, when the prefill worker tells this worker directly, the layers it said are
    in the arena and the claims this worker owes the store a release of; when the prefill
    worker lends its own pages, the layers it said are in them, and the connections this
    worker owes a `ReleaseNotice` (`lenders`) or has refused (`refused`: their later page
    notices are refused too, as the prefill worker may have taken the pages back)."""

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
    arrived: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    join_error: HalfmoonError | None = None


@dataclasses.dataclass(slots=True)
class ReceiveTimings:
    """When a request's KV arrived (wall-clock seconds since epoch)."""

    reserved_at: float
    first_layer_received_at: float = 0.0
    all_received_at: float = 0.0
    first_token_at: float = 0.0  # the first token became known here
    joined_at: float = 0.0
    num_bytes: int = 0


class DecodeWorker(EngineWorker):
    """Continuous-batching decode over KV received from the store; also serves colocated mode."""

    kind = "decode"

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        store=None,
        get_timeout_s: float = 30.0,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
        early_notice_s: float = EARLY_NOTICE_S,
    ):
        super().__init__(name, LLMEngine(config))
        self.store = store
        self.get_timeout_s = get_timeout_s
        self.handoff_timeout_s = handoff_timeout_s
        self.early_notice_s = early_notice_s
        self.expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired_reservations = 0
        self.chunk_tokens = config.prefill_chunk_size or config.max_num_batched_tokens
        self.receives: dict[str, asyncio.Task] = {}  # reserved, not handed over yet
        # Handed over (`generate` waits for the last layer): whoever takes a receive out of
        # here (`generate` or `abort`) frees its pages, so a retry's later reservation under
        # the same request id is never freed or joined by the attempt it replaced.
        self.joining: dict[str, asyncio.Task] = {}
        self.stores: dict[str, object] = {}
        self.arenas: dict[object, MappedArena | None] = {}  # by store handle, mapped once
        self.num_shared_reads = 0
        self.transfers: list[tuple[int, float]] = []  # (bytes, seconds) of finished receives
        self.timings: OrderedDict[str, ReceiveTimings] = OrderedDict()
        self.listener: NoticeListener | None = None
        self.reservations: dict[str, _Reservation] = {}  # by request id
        self.by_key: dict[str, _Reservation] = {}  # by the key notices name them by
        # Notices that overtook their reserve, with the connection each came on.
        self.early: dict[str, list[tuple[Notice, NoticeConn]]] = {}
        self.ended_keys: OrderedDict[str, None] = OrderedDict()
        self.num_direct_receives = 0
        self.num_early_joins = 0
        self.num_page_copies = 0  # layers copied out of a prefill worker's lent pages
        self.num_lenders = 0  # prefill workers' caches opened
        # Connections whose lender's cache is being opened: their page notices wait for it.
        self.opening: dict[NoticeConn, asyncio.Future] = {}
        self.node_store = store  # this node's store, where notices' claims are released

    def _extra_counters(self) -> dict:
        return {
            "num_receiving": len(self.receives) + len(self.joining),
            "num_expired_reservations": self.num_expired_reservations,
            "num_shared_reads": self.num_shared_reads,
            "num_direct_receives": self.num_direct_receives,
            "num_early_joins": self.num_early_joins,
            "num_page_copies": self.num_page_copies,
            "num_lenders": self.num_lenders,
            "num_malformed_notices": self.listener.num_malformed if self.listener else 0,
        }

    async def kv_peer(self) -> KvPeer:
        """Where prefill workers on this node send their notices (kvstore/kv_notices.py)."""
        if self.listener is None:
            node = ray.get_runtime_context().get_node_id()
            self.listener = NoticeListener(node, self._on_notice, self._on_closed)
        return self.listener.peer

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        store_name: str | None = None,
        ticket: str | None = None,
        direct: bool = False,
        first_token_id: int | None = None,
    ) -> int | WorkerError:
        """Hold pages for the prompt and start pulling its KV from the store node the prefill
        worker publishes to (`store_name`; default: ours); returns the pages held. A reserve
        whose `ticket` was aborted already holds nothing.

        `direct`: the prefill worker was given this worker's `kv_peer`; when that store is on
        this node, the layers are taken from its arena as the prefill worker's notices say.
        `first_token_id`: the request's first token, when already known (a retry): the
        request joins the batch as soon as its KV is in, as it does on the prefill worker's
        notice of the first token; otherwise on `generate`."""
        if self._was_aborted(ticket):
            return aborted(request_id)
        try:
            store = self._store(store_name)
            pages = self._engine().reserve(prompt_token_ids, params, request_id)
        except HalfmoonError as error:
            return WorkerError.of(error)
        reservation = _Reservation(ticket or request_id, asyncio.get_running_loop().create_future())
        reservation.direct = direct and self.listener is not None
        if first_token_id is not None:
            reservation.first_token.set_result(first_token_id)
        self.reservations[request_id] = self.by_key[reservation.key] = reservation
        for notice, conn in self.early.pop(reservation.key, []):
            self._on_notice(notice, conn)
        units = plan_transfer(
            self.engine.root_key,
            prompt_token_ids,
            self.engine.config.block_size,
            self.chunk_tokens,
            request_id,
        )
        timings = ReceiveTimings(reserved_at=time.time())
        self._record(request_id, timings)
        reservation.first_token.add_done_callback(
            lambda _: setattr(timings, "first_token_at", time.time())
        )
        receive = asyncio.create_task(
            self._receive(store, request_id, units, pages, store_name, reservation)
        )
        receive.add_done_callback(lambda task: self._await_handoff(request_id, task))
        self.receives[request_id] = receive
        return len(pages)

    async def generate(
        self, request_id: str, first_token_id: int
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Wait for the last layer, join the batch, and stream the request's outputs; a
        failure is the last item, as a `WorkerError`."""
        called_at = time.time()
        receive = self.receives.pop(request_id, None)
        if receive is None and request_id in self.expired:
            yield WorkerError(
                "UNAVAILABLE",
                f"the reservation of {request_id} was freed: nothing claimed it "
                f"{self.handoff_timeout_s:g} s after its KV landed",
                retryable=True,
            )
            return
        if receive is None:
            yield WorkerError("NOT_FOUND", f"request {request_id} has no reservation here")
            return
        engine = self._engine()
        reservation = self.reservations[request_id]
        if not reservation.first_token.done():
            reservation.first_token.set_result(first_token_id)
        self.joining[request_id] = receive
        failure = None
        try:
            await asyncio.wait_for(receive, self.get_timeout_s)
        except asyncio.CancelledError:
            failure = aborted(request_id)
        except TimeoutError:
            failure = WorkerError(
                "UNAVAILABLE",
                f"the KV of {request_id} was not all in the store {self.get_timeout_s} s after "
                "its prefill ended (store.get_timeout_s)",
                retryable=True,
            )
        except Exception as error:  # noqa: BLE001 - the router learns why, as data
            failure = WorkerError(
                "UNAVAILABLE", f"receiving the KV of {request_id} failed: {error}", retryable=True
            )
        if self.joining.get(request_id) is not receive:  # `abort` took it (and freed it)
            yield aborted(request_id)
            return
        del self.joining[request_id]
        if failure is not None:
            self._free(request_id)
            yield failure
            return
        self._forget(request_id)
        if reservation.join_error is not None:  # `_receive` joined the batch, or tried to
            yield WorkerError.of(reservation.join_error)
            return
        async for out in _timed(_as_data(engine.stream(request_id)), called_at):
            yield out

    async def generate_colocated(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        ticket: str | None = None,
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Prefill and decode here (colocated mode and short-prompt bypass)."""
        called_at = time.time()
        if self._was_aborted(ticket):
            yield aborted(request_id)
            return
        outputs = _as_data(self._engine().generate(prompt_token_ids, params, request_id))
        async for out in _timed(outputs, called_at):
            yield out

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the request here and free its pages; a reserve or colocated call with the same
        `ticket` that lands later is refused."""
        self._remember_abort(ticket)
        receive = self.receives.pop(request_id, None) or self.joining.pop(request_id, None)
        if receive is not None:
            receive.cancel()
            return self._free(request_id)
        return self._engine().abort(request_id)

    def _await_handoff(self, request_id: str, receive: asyncio.Task) -> None:
        """The receive failed: free its pages unless `generate` or `abort` claims it within
        `handoff_timeout_s` (its router died between the reserve and the hand-off). A receive
        whose KV landed armed the same timer then (`_receive`)."""
        if receive.cancelled() or self.receives.get(request_id) is not receive:
            return  # aborted, or already handed over
        if receive.exception() is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.handoff_timeout_s, self._expire, request_id, receive)

    def _expire(self, request_id: str, receive: asyncio.Task) -> None:
        if self.receives.get(request_id) is not receive:
            return
        del self.receives[request_id]
        failure = None
        if receive.done() and not receive.cancelled():
            failure = receive.exception()  # retrieved, so asyncio does not log it as lost
        receive.cancel()  # it may wait for a first token that no hand-off will bring
        log.warning(
            "freed the reservation of %s: no hand-off %g s after its KV %s",
            request_id,
            self.handoff_timeout_s,
            "landed" if failure is None else f"failed ({failure})",
        )
        self.num_expired_reservations += 1
        self.expired[request_id] = None
        while len(self.expired) > EXPIRED_IDS:
            self.expired.popitem(last=False)
        self._free(request_id)

    def _free(self, request_id: str) -> bool:
        """Abort a request whose KV was being received: its pages are freed (and lent pages
        it copied from given back) only once the writes already issued have landed."""
        self.engine.kv.wait_writes()
        self._forget(request_id)
        return self._engine().abort(request_id)

    def _forget(self, request_id: str) -> None:
        """The reservation's notices are not needed any more: later ones are released."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is None:
            return
        if self.by_key.get(reservation.key) is reservation:
            del self.by_key[reservation.key]
        self.ended_keys[reservation.key] = None
        while len(self.ended_keys) > RECENT_KEYS:
            self.ended_keys.popitem(last=False)
        self._release([n.lease for n in reservation.layers.values()])
        reservation.layers.clear()
        self._answer_lenders(reservation)

    def _answer_lenders(self, reservation: _Reservation) -> None:
        """Tell each prefill worker that lent this receive pages that it needs none any more
        (the copies out of them have landed: callers wait for the writes first)."""
        conns = reservation.lenders | {conn for _, conn in reservation.pages.values()}
        reservation.pages.clear()
        reservation.lenders.clear()
        for conn in conns:
            self._refuse(reservation, conn)

    def _on_notice(self, notice: Notice, conn: NoticeConn) -> None:
        """A notice from a prefill worker (the listener's callback, in the event loop)."""
        if isinstance(notice, Hello):
            self.opening[conn] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._open_lender(conn))
            return
        reservation = self.by_key.get(notice.key)
        if reservation is None:
            if notice.key in self.ended_keys:  # its receive ended: nothing will copy it
                self._release([notice.lease] if isinstance(notice, LayerNotice) else [])
                if isinstance(notice, PagesNotice):
                    conn.reply(ReleaseNotice(notice.key))
                return
            if notice.key not in self.early:
                asyncio.get_running_loop().call_later(
                    self.early_notice_s, self._drop_early, notice.key
                )
            self.early.setdefault(notice.key, []).append((notice, conn))
            return
        if isinstance(notice, TokenNotice):
            if not reservation.first_token.done():
                reservation.first_token.set_result(notice.token_id)
            return
        if isinstance(notice, PagesNotice):
            opened = conn.cache is not None or conn in self.opening  # or soon will be
            if not (reservation.direct and opened and not conn.closed):
                self._refuse(reservation, conn)
                return
            if conn in reservation.refused:
                return
            reservation.lenders.add(conn)
            reservation.pages[(notice.unit, notice.layer)] = (notice, conn)
            reservation.arrived.set()
            return
        if not reservation.direct or (notice.unit, notice.layer) in reservation.copied:
            self._release([notice.lease])  # through the store stream, or copied already
            return
        reservation.layers[(notice.unit, notice.layer)] = notice
        reservation.arrived.set()

    def _refuse(self, reservation: _Reservation, conn: NoticeConn) -> None:
        """Take none of `conn`'s lent pages for this receive (the arena's copies instead):
        told once, for all of them, so the lender may give them back at once."""
        if conn not in reservation.refused:
            reservation.refused.add(conn)
            conn.reply(ReleaseNotice(reservation.key))

    def _drop_early(self, key: str) -> None:
        """Notices whose reserve never came: give their claims and lent pages back."""
        early = self.early.pop(key, [])
        self._release([n.lease for n, _ in early if isinstance(n, LayerNotice)])
        for conn in {conn for n, conn in early if isinstance(n, PagesNotice)}:
            conn.reply(ReleaseNotice(key))

    def _on_closed(self, conn: NoticeConn) -> None:
        """A prefill worker's connection ended: the pages it lent are not held any more, so a
        receive still copying from them fails (the router retries it)."""
        for reservation in self.reservations.values():
            if conn in reservation.lenders and not reservation.lender_lost:
                reservation.lender_lost = True
                reservation.arrived.set()

    async def _open_lender(self, conn: NoticeConn) -> None:
        """Open the KV cache of the prefill worker that said hello on `conn`, so its page
        notices can be copied from; until then (or if it cannot be) they are refused and its
        layers come through the arena."""
        try:
            lender = ray.get_actor(conn.lender)
            export = await lender.kv_export.remote()
            if export is None:
                raise ValueError("it does not lend its pages")
            conn.cache = self.engine.kv.open_peer(export)
            self.num_lenders += 1
            log.info("copying KV straight out of the pages of %s", conn.lender)
        except Exception as error:  # noqa: BLE001 - the arena path stays; say why once
            log.warning("cannot open the KV cache of %s: %s", conn.lender, error)
        finally:
            self.opening.pop(conn).set_result(conn.cache is not None)

    def _release(self, leases: list[int]) -> None:
        """Give claims back to this node's store (which the prefill worker's notices name);
        its handle is looked up once (a lookup asks Ray's GCS, ~1 ms, in the event loop)."""
        leases = [lease for lease in leases if lease]
        if not leases:
            return
        if self.node_store is None:
            self.node_store = self._store(None)
        self.node_store.release_many.remote(leases)

    async def drain_transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds from reservation to last layer) of each KV receive since last call."""
        transfers, self.transfers = self.transfers, []
        return transfers

    async def receive_timings(self, request_id: str) -> ReceiveTimings | None:
        return self.timings.get(request_id)

    def _store(self, name: str | None):
        if name is None:
            return self.store if self.store is not None else local_store()
        if name not in self.stores:
            self.stores[name] = ray.get_actor(name)
        return self.stores[name]

    async def _arena(self, store, store_name: str | None) -> MappedArena | None:
        """The store node's shared arena, when it is on this node (mapped once per store)."""
        key = store_name or id(store)
        if key not in self.arenas:
            info = await store.arena_info.remote()
            self.arenas[key] = map_arena(info, ray.get_runtime_context().get_node_id())
        return self.arenas[key]

    async def _receive(
        self,
        store,
        request_id: str,
        units,
        pages: list[int],
        store_name: str | None,
        reservation: _Reservation,
    ) -> None:
        """Copy the prompt's KV into `pages`, then join the batch once the first token is
        known (the join's own error is kept for `generate`)."""
        arena = await self._arena(store, store_name)
        if reservation.direct and arena is not None:
            self.num_direct_receives += 1
            await self._receive_notified(request_id, units, pages, arena, reservation)
        else:
            if reservation.direct:  # the store is elsewhere after all: its stream it is
                reservation.direct = False
                self._release([n.lease for n in reservation.layers.values()])
                reservation.layers.clear()
                self._answer_lenders(reservation)
            await self._receive_streamed(store, request_id, units, pages, arena)
        # The KV is in: from now on, a hand-off is due within handoff_timeout_s.
        asyncio.get_running_loop().call_later(
            self.handoff_timeout_s, self._expire, request_id, asyncio.current_task()
        )
        token = reservation.first_token
        if not token.done():
            await token
        if self.receives.get(request_id) is asyncio.current_task():
            self.num_early_joins += 1  # joining before the router's hand-off (`generate`)
        self.timings[request_id].joined_at = time.time()
        try:
            self._engine().join(request_id, token.result())
        except HalfmoonError as error:
            reservation.join_error = error

    async def _receive_notified(
        self, request_id: str, units, pages: list[int], arena: MappedArena, reservation
    ) -> None:
        """Each layer of each unit from the prefill worker's own pages or the arena slots its
        notices name (the pages when both are offered: they come first, and cost one copy on
        the device); each unit's claim is released once its last layer is copied, the lent
        pages once everything has landed."""
        kv_cache = self.engine.kv
        timings = self.timings[request_id]
        written = None
        async with asyncio.timeout(PREFILL_WAIT_S):  # the router aborts long before
            for index, unit in enumerate(units):
                unit_pages = pages[unit.first_block : unit.first_block + len(unit.keys)]
                for layer in range(kv_cache.num_layers):
                    where = (index, layer)
                    lent, notice = await self._next_offer(reservation, where)
                    if lent is not None:
                        pages_notice, conn = lent
                        reservation.copied.add(where)
                        if (slots := reservation.layers.pop(where, None)) is not None:
                            self._release([slots.lease])
                        named, size = pages_notice.pages, conn.cache.num_pages
                        _check_places(pages_notice, named, "pages", len(unit.keys), size)
                        written = kv_cache.copy_pages(layer, conn.cache, named, unit_pages)
                        self.num_page_copies += 1
                        timings.num_bytes += len(unit_pages) * kv_cache.page_layer_bytes
                    else:
                        try:
                            size = arena.pages.shape[0]
                            _check_places(notice, notice.slots, "slots", len(unit.keys), size)
                            pin = kv_cache.device.type == "cuda"
                            kv = arena.read(notice.slots, layer, pin=pin)
                        finally:
                            self._release([notice.lease])  # copied out (or never will be)
                        self.num_shared_reads += 1
                        written = kv_cache.write_layer(layer, unit_pages, kv, ordered=False)
                        timings.num_bytes += kv.nbytes
                    if not timings.first_layer_received_at:
                        timings.first_layer_received_at = time.time()
        await self._all_written(written, timings)
        self._answer_lenders(reservation)

    async def _next_offer(
        self, reservation: _Reservation, where: tuple[int, int]
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
                self._refuse(reservation, conn)  # it could not be opened: the arena's copy
                continue
            if (notice := reservation.layers.pop(where, None)) is not None:
                return None, notice
            reservation.arrived.clear()
            await reservation.arrived.wait()

    async def _receive_streamed(
        self, store, request_id: str, units, pages: list[int], arena: MappedArena | None
    ) -> None:
        kv_cache = self.engine.kv
        timings = self.timings[request_id]
        # One stream for the whole prompt: the store sends each layer of each unit as soon as
        # it is put, so a prompt whose KV is all published costs one round trip, and the
        # store holds one call for this request however many units and layers it has. On
        # the store's own node it sends only where the layer is in its shared arena, and
        # the layer is copied from there (no Ray object carries it).
        method = store.stream_layers if arena is None else store.stream_slots
        extra = () if arena is None else (f"{request_id}/{uuid.uuid4().hex}",)
        stream = method.options(num_returns="streaming").remote(
            [unit.keys for unit in units],
            kv_cache.num_layers,
            max(self.get_timeout_s, PREFILL_WAIT_S),
            *extra,
        )
        written = None  # the last layer write: on CUDA it lands after it is issued
        try:
            for unit in units:
                unit_pages = pages[unit.first_block : unit.first_block + len(unit.keys)]
                for layer in range(kv_cache.num_layers):
                    item = await (await anext(stream))
                    if arena is None:
                        kv = item
                    else:
                        slots, _ = item  # the stream's leases end with end_stream
                        kv = arena.read(slots, layer, pin=kv_cache.device.type == "cuda")
                        self.num_shared_reads += 1
                    written = kv_cache.write_layer(layer, unit_pages, kv, ordered=False)
                    timings.num_bytes += kv.nbytes
                    if not timings.first_layer_received_at:
                        timings.first_layer_received_at = time.time()
        except BaseException:
            ray.cancel(stream)  # aborted or failed: the store stops waiting for the rest
            raise
        finally:
            if extra:  # the layers are copied out (or never will be): the slots may go
                store.end_stream.remote(*extra)
        await self._all_written(written, timings)

    async def _all_written(self, written, timings: ReceiveTimings) -> None:
        if written is not None and not written.done():  # writes land in order: the last says all
            await asyncio.to_thread(written.wait)
        timings.all_received_at = time.time()
        self.transfers.append((timings.num_bytes, timings.all_received_at - timings.reserved_at))

    def _record(self, request_id: str, timings: ReceiveTimings) -> None:
        self.timings[request_id] = timings
        while len(self.timings) > RECENT_TIMINGS:
            self.timings.popitem(last=False)


def _check_places(notice, places: tuple[int, ...], what: str, num_blocks: int, size: int) -> None:
    """A notice names one place (arena slot, lent page) per block of its unit, each among the
    `size` there are."""
    if len(places) != num_blocks or any(place >= size for place in places):
        raise ValueError(
            f"a notice for unit {notice.unit} layer {notice.layer} names {len(places)} {what} "
            f"(up to {max(places, default=0)}) for {num_blocks} blocks out of {size}"
        )


async def _as_data(
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[RequestOutput | WorkerError]:
    """The outputs, with a halfmoon error at the end turned into a last `WorkerError` item."""
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                yield out
        except HalfmoonError as error:
            yield WorkerError.of(error)


async def _timed(
    outputs: AsyncIterator[RequestOutput | WorkerError], called_at: float
) -> AsyncIterator[RequestOutput | WorkerError]:
    """The outputs, the first with the worker's stages added to its timeline (when the call
    began here, when it left); the others without one, as the trace reads only the first."""
    first = True
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            if isinstance(out, RequestOutput):
                if first:
                    out.timeline = (
                        ("call began on the worker", called_at),
                        *out.timeline,
                        ("first output left the worker", time.time()),
                    )
                    first = False
                else:
                    out.timeline = ()
            yield out
