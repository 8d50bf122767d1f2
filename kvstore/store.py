"""One node's KV store: host tier plus optional Redis tier, layer-wise put/get, events, stats."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from halfmoon.kvstore.block_events import BlockEvent, EventKind
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.errors import LayerTimeout, StoreFull
from halfmoon.kvstore.host_tier import EvictedBlock, HostTier, WriteResult
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.redis_tier import RedisTier
from halfmoon.kvstore.stats import StoreStats

log = logging.getLogger(__name__)

HOST = "host"
# `stream_slots` streams whose leases are tracked at once (the oldest are ended beyond it).
MAX_OPEN_STREAMS = 65536
REDIS = "redis"


class KvStore:
    """Host tier + Redis tier behind `put_layer` / `get_layer`; use in-process or via StoreNode.

    Not thread-safe: every method runs on one asyncio loop (the actor's, in serving).
    """

    def __init__(
        self,
        layout: KvLayout,
        config: StoreConfig | None = None,
        instance: str = "local",
        on_event: Callable[[BlockEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = layout
        self.config = config = config or StoreConfig()
        self.instance = instance
        self.redis = None
        if config.redis_url:
            key, password = config.redis_hmac_key, config.redis_password
            self.redis = RedisTier(
                config.redis_url, layout, config.redis_ttl_s, config.redis_prefix,
                config.redis_timeout_s, config.redis_retry_interval_s, clock,
                key.get_secret_value().encode() if key else None,
                password.get_secret_value() if password else None,
                config.redis_max_connections, config.redis_pool_timeout_s,
            )  # fmt: skip
        self.host = HostTier(
            layout, config.host_capacity_bytes, config.high_watermark, config.low_watermark,
            config.pending_ttl_s, self._demotes, clock, config.shared_arena,
        )  # fmt: skip
        self._on_event = on_event
        self._events: list[BlockEvent] = []
        self._ready: dict[int, asyncio.Condition] = {}
        self._demotions: set[asyncio.Task[None]] = set()
        self._backlog_bytes = 0
        self._stats = StoreStats()
        self._stream_holds: OrderedDict[str, list[int]] = OrderedDict()  # see stream_slots
        self._ended_streams: OrderedDict[str, None] = OrderedDict()

    @property
    def _demotes(self) -> bool:
        return self.redis is not None and self.config.demote_to_redis

    async def put_layer(self, keys: Sequence[bytes], layer: int, kv: LayerKV) -> None:
        """Store one layer of `keys` (K/V `[len(keys), *page_shape]`) and wake its readers."""
        start = time.perf_counter()
        self._absorb(self.host.write_layer(keys, layer, kv))
        self._stats.host.bytes_written += kv.nbytes
        await self._notify(layer)
        self._stats.put_latency.record(time.perf_counter() - start)

    def claim(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """Host slots for a producer that copies the layers of `keys` into the shared arena
        itself, and a lease holding them (release it with the last `layer_written`)."""
        slots, lease_id, result = self.host.claim(keys, self.config.pending_ttl_s)
        self._absorb(result)
        return slots, lease_id

    async def layer_written(
        self,
        keys: Sequence[bytes],
        layer: int | Sequence[int],
        slots: Sequence[int],
        release_lease: int | None = None,
    ) -> None:
        """A producer copied `layer` of `keys` (or each of several layers) into their claimed
        `slots`: wake its readers (as `put_layer` does), and release the claim's lease when
        given."""
        start = time.perf_counter()
        layers = [layer] if isinstance(layer, int) else list(layer)
        for each in layers:
            self._absorb(self.host.written(keys, each, slots))
        self._stats.host.bytes_written += len(layers) * len(keys) * self.layout.layer_bytes
        if release_lease is not None:
            self.host.release(release_lease)
        for each in layers:
            await self._notify(each)
        self._stats.put_latency.record(time.perf_counter() - start)

    async def get_layer(
        self, keys: Sequence[bytes], layer: int, timeout_s: float | None = None
    ) -> LayerKV:
        """One layer of `keys`; waits up to `timeout_s` for blocks not yet put, or LayerTimeout."""
        start = time.perf_counter()
        async with self._layer_ready(keys, layer, timeout_s):
            kv = self.host.read_layer(keys, layer)
        self._stats.host.bytes_read += kv.nbytes
        self._stats.get_latency.record(time.perf_counter() - start)
        return kv

    async def stream_slots(
        self,
        units: Sequence[Sequence[bytes]],
        num_layers: int,
        timeout_s: float | None = None,
        stream_id: str = "",
    ) -> AsyncIterator[tuple[list[int], int]]:
        """`stream_layers` for a reader on this node that maps the shared arena: each item is
        the unit's slots (the layer is in them) and a lease that keeps them from eviction.
        The reader calls `end_stream(stream_id)` once it copies no more (done, aborted or
        failed): that releases every lease the stream granted, items sent ahead included;
        a reader that never does loses them after `lease_ttl_s`."""
        holds = self._stream_holds.setdefault(stream_id, [])
        while len(self._stream_holds) > MAX_OPEN_STREAMS:
            self.end_stream(next(iter(self._stream_holds)))
        for keys in units:
            for layer in range(num_layers):
                start = time.perf_counter()
                async with self._layer_ready(keys, layer, timeout_s):
                    if stream_id in self._ended_streams:
                        return  # its reader gave up while this layer was awaited
                    holds.append(self.host.lease(keys, self.config.lease_ttl_s))
                    slots = self.host.slots_of(keys)
                self._stats.host.bytes_read += len(keys) * self.layout.layer_bytes
                self._stats.get_latency.record(time.perf_counter() - start)
                yield slots, holds[-1]

    def end_stream(self, stream_id: str) -> None:
        """Release every lease a `stream_slots` stream granted; it grants no more."""
        self._ended_streams[stream_id] = None
        while len(self._ended_streams) > MAX_OPEN_STREAMS:
            self._ended_streams.popitem(last=False)
        for lease_id in self._stream_holds.pop(stream_id, []):
            self.host.release(lease_id)

    @contextlib.asynccontextmanager
    async def _layer_ready(
        self, keys: Sequence[bytes], layer: int, timeout_s: float | None
    ) -> AsyncIterator[None]:
        """Inside: every block of `keys` holds `layer` (promoted from Redis where it can be,
        waited for up to `timeout_s` otherwise, or LayerTimeout), leased."""
        timeout_s = self.config.get_timeout_s if timeout_s is None else timeout_s
        missing = self.host.missing(keys, layer)
        self._stats.host.hits += len(keys) - len(missing)
        self._stats.host.misses += len(missing)
        if missing and self.redis is not None:
            await self._promote([keys[i] for i in missing], layer)
        lease_id = self.host.lease(keys, max(timeout_s, self.config.lease_ttl_s))
        try:
            await self._wait_for(keys, layer, lease_id, timeout_s)
            yield
        finally:
            self.host.release(lease_id)

    async def stream_layers(
        self, units: Sequence[Sequence[bytes]], num_layers: int, timeout_s: float | None = None
    ) -> AsyncIterator[LayerKV]:
        """Every layer of every unit of blocks, unit by unit and layer by layer, each as soon
        as it is put: `get_layer` in that order, each waiting up to `timeout_s` from the end
        of the one before. One reader, one call: a decode worker receives a whole prompt
        through a single stream instead of one call per unit and layer."""
        for keys in units:
            for layer in range(num_layers):
                yield await self.get_layer(keys, layer, timeout_s)

    def lease_slots(self, keys: Sequence[bytes]) -> tuple[list[int], int] | None:
        """For a reader on this node that maps the shared arena: the slots of `keys` and a
        lease holding them (release it once copied), when the host tier holds every layer of
        every one of them; else None (read them with `get_layer`, which promotes from Redis)."""
        if self.host.leading_complete(keys) < len(keys):
            return None
        lease_id = self.host.lease(keys, self.config.lease_ttl_s)
        self._stats.host.hits += len(keys)
        self._stats.host.bytes_read += len(keys) * self.layout.block_bytes
        return self.host.slots_of(keys), lease_id

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` the host tier holds with every layer."""
        return self.host.leading_complete(keys)

    async def prefix_depths(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks of `keys` the host tier held with every layer, blocks after them it
        holds once Redis's records of them are promoted into it): a prefix load then reads all
        of them from the host tier, and a forged or corrupt record is a miss here, never a
        load that waits for a layer that cannot come."""
        host = self.host.leading_complete(keys)
        if self.redis is None or host == len(keys):
            return host, 0
        depth = host + await self.redis.leading_depth(keys[host:])
        try:
            for layer in range(self.layout.num_layers if depth > host else 0):
                await self._promote(list(keys[host:depth]), layer)
        except StoreFull:  # leases hold the tier: the blocks not promoted are a miss, computed
            pass
        return host, self.host.leading_complete(keys) - host

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Protect the host blocks of `keys` from eviction until released or `ttl_s` passes."""
        return self.host.lease(keys, self.config.lease_ttl_s if ttl_s is None else ttl_s)

    def release(self, lease_id: int) -> bool:
        """Release a lease; False when it had already expired or been released."""
        return self.host.release(lease_id)

    def drain_events(self) -> list[BlockEvent]:
        """Stored/evicted events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    async def flush(self) -> None:
        """Wait for every demotion in flight to reach Redis (or fail)."""
        while self._demotions:
            await asyncio.gather(*self._demotions, return_exceptions=True)

    def stats(self) -> StoreStats:
        """A snapshot of tier contents, hits, misses, movement and latency (leases whose time
        is up are released first, so an idle store reports none)."""
        self.host.expire_leases()
        usage = self.host.usage()
        host = self._stats.host
        host.blocks, host.bytes_ = usage.complete_blocks, usage.used_bytes
        host.capacity_bytes, host.leased_blocks = usage.capacity_bytes, usage.leased_blocks
        host.evictions = self.host.num_evictions
        if self.redis is not None:
            self._stats.redis = replace(self.redis.stats)
            self._stats.redis_available = self.redis.available
        return copy.deepcopy(self._stats)

    async def close(self) -> None:
        await self.flush()
        if self.redis is not None:
            await self.redis.close()

    async def _promote(self, keys: list[bytes], layer: int) -> None:
        assert self.redis is not None
        hits = await self.redis.get_layer(keys, layer)
        if hits.corrupt_keys:
            self._emit("evicted", REDIS, hits.corrupt_keys)
        if hits.kv is None:
            return
        found = [keys[i] for i in hits.indices]
        self._absorb(self.host.write_layer(found, layer, hits.kv))
        self._stats.promotions += len(found)
        await self._notify(layer)

    async def _wait_for(
        self, keys: Sequence[bytes], layer: int, lease_id: int, timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        ready = self._ready.setdefault(layer, asyncio.Condition())
        async with ready:
            while missing := self.host.missing(keys, layer):
                self.host.extend_lease(lease_id, keys)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise LayerTimeout(layer, len(missing), len(keys), timeout_s)
                try:
                    await asyncio.wait_for(ready.wait(), remaining)
                except TimeoutError:
                    continue

    async def _notify(self, layer: int) -> None:
        ready = self._ready.get(layer)
        if ready is not None:
            async with ready:
                ready.notify_all()

    def _absorb(self, result: WriteResult) -> None:
        if result.completed:
            self._emit("stored", HOST, result.completed)
        if result.evicted:
            self._emit("evicted", HOST, [block.key for block in result.evicted])
            self._demote([block for block in result.evicted if block.data is not None])

    def _demote(self, blocks: list[EvictedBlock]) -> None:
        if not blocks or not self._demotes:
            return
        nbytes = len(blocks) * self.layout.block_bytes
        if self._backlog_bytes + nbytes > self.config.max_demotion_backlog_bytes:
            self._stats.demotions_dropped += len(blocks)
            return
        self._backlog_bytes += nbytes
        task = asyncio.get_running_loop().create_task(self._send_demotion(blocks, nbytes))
        self._demotions.add(task)
        task.add_done_callback(self._demotions.discard)

    async def _send_demotion(self, blocks: list[EvictedBlock], nbytes: int) -> None:
        assert self.redis is not None
        try:
            records = [
                record
                for block in blocks
                for record in self.redis.encode_block(block.key, block.data)
            ]
            stored = await self.redis.put_records(records)
        finally:
            self._backlog_bytes -= nbytes
        if stored:
            self._stats.demotions += len(blocks)
            self._emit("stored", REDIS, [block.key for block in blocks])
        else:
            self._stats.demotions_dropped += len(blocks)

    def _emit(self, kind: EventKind, tier: str, keys: list[bytes]) -> None:
        event = BlockEvent(kind, self.instance, tier, keys)
        self._events.append(event)
        if self._on_event is not None:
            self._on_event(event)
