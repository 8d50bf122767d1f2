"""The receive: a prompt's KV pulled into the pages reserved for it, unit by unit and layer
by layer as the prefill worker publishes it: from the store's stream; on its node, out of the
arena slots or lent pages its notices name; from another node, out of the staging slots it
wrote into on the transfer engine (decode_worker/engine_receive.py)."""

from __future__ import annotations

import asyncio
import time
import uuid

import ray

from halfmoon.decode_worker.engine_receive import EngineReceiver
from halfmoon.decode_worker.notices import Notices
from halfmoon.decode_worker.receives import Receive, ReceiveTimings
from halfmoon.engine.kv_cache import PagedKvCache
from halfmoon.kvstore.locate import local_store
from halfmoon.kvstore.shared_arena import MappedArena, map_arena
from halfmoon.kvstore.transfer.channel import NoticeConn
from halfmoon.kvstore.transfer.notice_format import LayerNotice, PagesNotice
from halfmoon.kvstore.transfer.plan import TransferUnit
from halfmoon.kvstore.transfer.staging import Grant

# Until the router hands the request over (its prefill returned), the reads wait for the
# prefill however long it queues and computes, up to this bound: the router aborts the
# reservation when the prefill fails or its worker dies. After the hand-off, what is still
# missing must land within `get_timeout_s`.
PREFILL_WAIT_S = 3600.0


class Receiver:
    """Copies prompts' KV into reserved pages, noting its timings on each receive."""

    def __init__(
        self,
        kv_cache: PagedKvCache,
        notices: Notices,
        store,
        get_timeout_s: float,
        engine: EngineReceiver,
    ):
        self.kv_cache = kv_cache  # the engine's: the reserved pages are written through it
        self.notices = notices
        self.engine = engine
        self.store = store
        self.get_timeout_s = get_timeout_s
        self.stores: dict[str, object] = {}
        self.arenas: dict[object, MappedArena | None] = {}  # by store name or handle id
        self.transfers: list[tuple[int, float]] = []  # (bytes, seconds) of finished receives
        self.num_shared_reads = 0
        self.num_direct_receives = 0
        self.num_page_copies = 0  # layers copied out of a prefill worker's lent pages
        self.num_engine_receives = 0  # from another node, on the transfer engine
        self.num_streamed_layers = 0  # layers that came as Ray objects of the store's stream

    def counters(self) -> dict:
        return {
            "num_shared_reads": self.num_shared_reads,
            "num_direct_receives": self.num_direct_receives,
            "num_page_copies": self.num_page_copies,
            "num_engine_receives": self.num_engine_receives,
            "num_streamed_layers": self.num_streamed_layers,
            **self.engine.counters(),
        }

    def store_named(self, name: str | None):
        """The store node `name` (default: this node's), looked up once."""
        if name is None:
            return self.store if self.store is not None else local_store()
        if name not in self.stores:
            self.stores[name] = ray.get_actor(name)
        return self.stores[name]

    def forget_store(self, name: str) -> None:
        """Store node `name` was replaced: look it up (and map its arena) afresh."""
        self.stores.pop(name, None)
        self.arenas.clear()  # mapped again on next use (this node's is keyed by its handle)

    def take_transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each receive finished since the last call."""
        transfers, self.transfers = self.transfers, []
        return transfers

    async def receive(
        self,
        store,
        receive: Receive,
        units: list[TransferUnit],
        pages: list[int],
        store_name: str | None,
    ) -> None:
        """Copy the prompt's KV into `pages`: as the notices say when told directly and the
        store is on this node; from another node, out of the staging slots its prefill worker
        wrote into when it took a grant; else from the store's stream."""
        if receive.engine is not None and (grant := await receive.engine) is not None:
            self.num_engine_receives += 1
            await self._engine_received(receive, units, pages, grant)
            return
        arena = await self._arena(store, store_name)
        if receive.direct and arena is not None:
            self.num_direct_receives += 1
            await self._notified(receive, units, pages, arena)
            return
        if receive.direct:  # the store is elsewhere after all: its stream it is
            receive.direct = False
            self.notices.undirect(receive)
        await self._streamed(store, receive, units, pages, arena)

    async def _arena(self, store, store_name: str | None) -> MappedArena | None:
        """The store node's shared arena, when it is on this node (mapped once per store)."""
        key = store_name or id(store)
        if key not in self.arenas:
            info = await asyncio.wait_for(store.arena_info.remote(), self.get_timeout_s)
            self.arenas[key] = map_arena(info, ray.get_runtime_context().get_node_id())
        return self.arenas[key]

    async def _notified(
        self, receive: Receive, units, pages: list[int], arena: MappedArena
    ) -> None:
        """Each layer of each unit from the prefill worker's own pages or the arena slots its
        notices name (the pages when both are offered: they come first, and cost one copy on
        the device); each unit's claim is released once its last layer is copied, the lent
        pages once everything has landed."""
        timings = receive.timings
        written = None
        async with asyncio.timeout(PREFILL_WAIT_S):  # the router aborts long before
            for index, unit in enumerate(units):
                unit_pages = pages[unit.first_block : unit.first_block + len(unit.keys)]
                for layer in range(self.kv_cache.num_layers):
                    where = (index, layer)
                    lent, notice = await self.notices.next_offer(receive, where)
                    if lent is not None:
                        written = self._copy_lent(receive, where, lent, unit_pages)
                    else:
                        written = self._copy_slots(arena, notice, layer, unit_pages, receive)
                    _first_layer(timings)
        await self._all_written(written, timings)
        self.notices.answer_lenders(receive)

    def _copy_lent(
        self,
        receive: Receive,
        where: tuple[int, int],
        lent: tuple[PagesNotice, NoticeConn],
        unit_pages: list[int],
    ):
        """One layer out of a prefill worker's lent pages (its arena copy, if offered, goes)."""
        kv_cache = self.kv_cache
        pages_notice, conn = lent
        receive.copied.add(where)
        if (slots := receive.layers.pop(where, None)) is not None:
            self.notices.release([slots.lease])
        named = pages_notice.pages
        _check_places(pages_notice, named, "pages", len(unit_pages), conn.cache.num_pages)
        written = kv_cache.copy_pages(where[1], conn.cache, named, unit_pages, receive.fence)
        self.num_page_copies += 1
        receive.timings.num_bytes += len(unit_pages) * kv_cache.page_layer_bytes
        return written

    def _copy_slots(
        self,
        arena: MappedArena,
        notice: LayerNotice,
        layer: int,
        unit_pages: list[int],
        receive: Receive,
    ):
        """One layer out of the arena slots a notice names; its claim is released after."""
        kv_cache = self.kv_cache
        try:
            size = arena.pages.shape[0]
            _check_places(notice, notice.slots, "slots", len(unit_pages), size)
            kv = arena.read(notice.slots, layer, pin=kv_cache.device.type == "cuda")
        finally:
            self.notices.release([notice.lease])  # copied out (or never will be)
        self.num_shared_reads += 1
        receive.timings.num_bytes += kv.nbytes
        return kv_cache.write_layer(layer, unit_pages, kv, ordered=False, after=receive.fence)

    async def _engine_received(
        self, receive: Receive, units, pages: list[int], grant: Grant
    ) -> None:
        """Each layer of each unit out of the staging slots, once its landed notice came."""
        kv_cache, staging = self.kv_cache, self.engine.staging
        timings = receive.timings
        written, clean = None, False
        self.engine.opened()
        try:
            async with asyncio.timeout(PREFILL_WAIT_S):  # the router aborts long before
                for index, unit in enumerate(units):
                    first, count = unit.first_block, len(unit.keys)
                    for layer in range(kv_cache.num_layers):
                        while (index, layer) not in receive.landed:
                            receive.arrived.clear()
                            await receive.arrived.wait()
                        kv = staging.layer(grant, layer, first, count)
                        written = kv_cache.write_layer(
                            layer,
                            pages[first : first + count],
                            kv,
                            ordered=False,
                            after=receive.fence,
                        )
                        timings.num_bytes += kv.nbytes
                        _first_layer(timings)
            await self._all_written(written, timings)
            clean = True
        finally:
            self.engine.closed(receive, grant, clean)

    async def _streamed(
        self, store, receive: Receive, units, pages: list[int], arena: MappedArena | None
    ) -> None:
        kv_cache, timings, after = self.kv_cache, receive.timings, receive.fence
        # One stream for the whole prompt: the store sends each layer of each unit as soon as
        # it is put, so a prompt whose KV is all published costs one round trip, and the
        # store holds one call for this request however many units and layers it has. On
        # the store's own node it sends only where the layer is in its shared arena, and
        # the layer is copied from there (no Ray object carries it).
        method = store.stream_layers if arena is None else store.stream_slots
        extra = () if arena is None else (f"{receive.request_id}/{uuid.uuid4().hex}",)
        wait_s = max(self.get_timeout_s, PREFILL_WAIT_S)  # the store's, for each layer
        stream = method.options(num_returns="streaming").remote(
            [unit.keys for unit in units], kv_cache.num_layers, wait_s, *extra
        )
        written = None  # the last layer write: on CUDA it lands after it is issued
        try:
            for unit in units:
                unit_pages = pages[unit.first_block : unit.first_block + len(unit.keys)]
                for layer in range(kv_cache.num_layers):
                    # Twice the store's own wait: a store that hangs holds no receive forever.
                    item = await asyncio.wait_for(_next_item(stream), 2 * wait_s)
                    if arena is None:
                        kv = item
                    else:
                        slots, _ = item  # the stream's leases end with end_stream
                        kv = arena.read(slots, layer, pin=kv_cache.device.type == "cuda")
                        self.num_shared_reads += 1
                    written = kv_cache.write_layer(
                        layer, unit_pages, kv, ordered=False, after=after
                    )
                    self.num_streamed_layers += arena is None
                    timings.num_bytes += kv.nbytes
                    _first_layer(timings)
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


async def _next_item(stream):
    return await (await anext(stream))


def _first_layer(timings: ReceiveTimings) -> None:
    if not timings.first_layer_received_at:
        timings.first_layer_received_at = time.time()


def _check_places(notice, places: tuple[int, ...], what: str, num_blocks: int, size: int) -> None:
    """A notice names one place (arena slot, lent page) per block of its unit, each among the
    `size` there are."""
    if len(places) != num_blocks or any(place >= size for place in places):
        raise ValueError(
            f"a notice for unit {notice.unit} layer {notice.layer} names {len(places)} {what} "
            f"(up to {max(places, default=0)}) for {num_blocks} blocks out of {size}"
        )
