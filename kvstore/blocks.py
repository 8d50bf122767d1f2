"""One node's keyed blocks in tiers (host arena, optional Redis): put, get, query, lease, evict.

Like Mooncake Store's client it knows nothing of requests: a block is a key with one record
per layer, and waiting for a layer that is not there yet is the streams' part (streams.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from halfmoon.kvstore.block_events import BlockEvent, EventKind
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.errors import StoreFull
from halfmoon.kvstore.host_tier import EvictedBlock, HostTier, WriteResult
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.redis_tier import RedisTier
from halfmoon.kvstore.shared_arena import ArenaInfo
from halfmoon.kvstore.stats import StoreStats

HOST = "host"
REDIS = "redis"
HELD_KEYS = 1 << 18  # keys a tier's snapshot lists at most (tens of MB of the store's memory)


class BlockStore:
    """Host tier + Redis tier of one node, keyed by block; evicted host blocks demote to Redis.
    Not thread-safe: every method runs on one asyncio loop (the actor's, in serving)."""

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
        self._redis = _redis_tier(layout, config, clock)
        self._host = _host_tier(layout, config, clock, keep_evicted=self._demotes)
        self._on_event = on_event
        self._events: list[BlockEvent] = []
        # tier -> keys it holds, as its events say; the newest HELD_KEYS of a tier (Redis
        # expires keys unseen: an old one may be gone already, as it may from the index).
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self._arrivals: dict[int, asyncio.Event] = {}
        self._demotions: set[asyncio.Task[None]] = set()
        self._backlog_bytes = 0
        self._stats = StoreStats()

    @property
    def _demotes(self) -> bool:
        return self._redis is not None and self.config.demote_to_redis

    def put_layer(self, keys: Sequence[bytes], layer: int, kv: LayerKV) -> None:
        """Store one layer of `keys` (K/V `[len(keys), *page_shape]`)."""
        start = time.perf_counter()
        self._absorb(self._host.write_layer(keys, layer, kv))
        self._stats.host.bytes_written += kv.nbytes
        self._arrived(layer)
        self._stats.put_latency.record(time.perf_counter() - start)

    def claim(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """Host slots for a producer that copies the layers of `keys` into the shared arena
        itself, and a lease holding them (release it with the last `layer_written`)."""
        slots, lease_id, result = self._host.claim(keys, self.config.pending_ttl_s)
        self._absorb(result)
        return slots, lease_id

    def layer_written(
        self,
        keys: Sequence[bytes],
        layer: int | Sequence[int],
        slots: Sequence[int],
        release_lease: int | None = None,
    ) -> None:
        """A producer copied `layer` of `keys` (or each of several layers) into their claimed
        `slots`: as `put_layer`, and release the claim's lease when given."""
        start = time.perf_counter()
        layers = [layer] if isinstance(layer, int) else list(layer)
        for each in layers:
            self._absorb(self._host.written(keys, each, slots))
        self._stats.host.bytes_written += len(layers) * len(keys) * self.layout.layer_bytes
        if release_lease is not None:
            self._host.release(release_lease)
        for each in layers:
            self._arrived(each)
        self._stats.put_latency.record(time.perf_counter() - start)

    async def fetch_layer(self, keys: Sequence[bytes], layer: int) -> None:
        """Count the host tier's hits and misses of `layer` of `keys`, and promote the misses
        Redis holds into it."""
        missing = self._host.missing(keys, layer)
        self._stats.host.hits += len(keys) - len(missing)
        self._stats.host.misses += len(missing)
        if missing and self._redis is not None:
            await self._promote([keys[i] for i in missing], layer)

    def missing(self, keys: Sequence[bytes], layer: int) -> list[int]:
        """Indices into `keys` of the blocks whose `layer` the host tier does not hold."""
        return self._host.missing(keys, layer)

    def next_arrival(self, layer: int) -> asyncio.Event:
        """An event set when `layer` of some block next arrives (put, written or promoted)."""
        return self._arrivals.setdefault(layer, asyncio.Event())

    def read_layer(self, keys: Sequence[bytes], layer: int) -> LayerKV:
        """A copy of `layer` of `keys`; the host tier must hold it for each (else KeyError)."""
        kv = self._host.read_layer(keys, layer)
        self._stats.host.bytes_read += kv.nbytes
        return kv

    def lease_layer(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        """For a reader of the shared arena that awaited one layer of `keys` (held for each):
        their slots and a lease holding them."""
        lease_id = self.lease(keys)
        self._stats.host.bytes_read += len(keys) * self.layout.layer_bytes
        return self._host.slots_of(keys), lease_id

    def lease_slots(self, keys: Sequence[bytes]) -> tuple[list[int], int] | None:
        """For a reader of the shared arena: the slots of `keys` and a lease holding them
        when the host tier holds every layer of each, else None (`fetch_layer` promotes)."""
        if self._host.leading_complete(keys) < len(keys):
            return None
        lease_id = self.lease(keys)
        self._stats.host.hits += len(keys)
        self._stats.host.bytes_read += len(keys) * self.layout.block_bytes
        return self._host.slots_of(keys), lease_id

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` the host tier holds with every layer."""
        return self._host.leading_complete(keys)

    async def prefix_depths(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """(leading blocks of `keys` the host tier held whole, blocks after them it holds once
        Redis's are promoted): a forged record is a miss here, never a layer awaited in vain."""
        host = self._host.leading_complete(keys)
        if self._redis is None or host == len(keys):
            return host, 0
        depth = host + await self._redis.leading_depth(keys[host:])
        try:
            for layer in range(self.layout.num_layers if depth > host else 0):
                await self._promote(list(keys[host:depth]), layer)
        except StoreFull:  # leases hold the tier: the blocks not promoted are a miss, computed
            pass
        return host, self._host.leading_complete(keys) - host

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        """Protect the host blocks of `keys` from eviction until released or `ttl_s` passes."""
        return self._host.lease(keys, self.config.lease_ttl_s if ttl_s is None else ttl_s)

    def extend_lease(self, lease_id: int, keys: Sequence[bytes]) -> None:
        """Add the blocks of `keys` that have since arrived to a live lease."""
        self._host.extend_lease(lease_id, keys)

    def release(self, lease_id: int) -> bool:
        """Release a lease; False when it had already expired or been released."""
        return self._host.release(lease_id)

    def arena_info(self, node_id: str) -> ArenaInfo | None:
        """Where producers on Ray node `node_id` map the host tier (None: not shared)."""
        path = self._host.arena_path
        return None if path is None else ArenaInfo(path, node_id, self._host.num_slots, self.layout)

    def arena_memory(self) -> tuple[int, int]:
        """The host tier's arena: its address and size in bytes."""
        return self._host.memory()

    def drain_events(self) -> list[BlockEvent]:
        """Stored/evicted events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[BlockEvent]:
        """Every block its tiers hold now, one `stored` event a tier (a new router's prefix
        index starts from it); the events not yet drained are in it and dropped."""
        self._events = []
        return [
            BlockEvent("stored", self.instance, tier, sorted(keys))
            for tier, keys in self._held.items()
        ]

    async def flush(self) -> None:
        """Wait for every demotion in flight to reach Redis (or fail)."""
        while self._demotions:
            await asyncio.gather(*self._demotions, return_exceptions=True)

    def stats(self) -> StoreStats:
        """A snapshot of tier contents, hits, misses, movement and put latency (leases whose
        time is up are released first, so an idle store reports none)."""
        self._host.expire_leases()
        usage, host = self._host.usage(), self._stats.host
        host.blocks, host.bytes_ = usage.complete_blocks, usage.used_bytes
        host.capacity_bytes, host.leased_blocks = usage.capacity_bytes, usage.leased_blocks
        host.evictions = self._host.num_evictions
        if self._redis is not None:
            self._stats.redis = replace(self._redis.stats)
            self._stats.redis_available = self._redis.available
        return copy.deepcopy(self._stats)

    async def close(self) -> None:
        """Finish the demotions in flight and close the Redis connections."""
        await self.flush()
        if self._redis is not None:
            await self._redis.close()

    async def _promote(self, keys: list[bytes], layer: int) -> None:
        assert self._redis is not None
        hits = await self._redis.get_layer(keys, layer)
        if hits.corrupt_keys:
            self._emit("evicted", REDIS, hits.corrupt_keys)
        if hits.kv is None:
            return
        found = [keys[i] for i in hits.indices]
        self._absorb(self._host.write_layer(found, layer, hits.kv))
        self._stats.promotions += len(found)
        self._arrived(layer)

    def _arrived(self, layer: int) -> None:
        arrival = self._arrivals.pop(layer, None)
        if arrival is not None:
            arrival.set()

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
        assert self._redis is not None
        try:
            records = [
                record
                for block in blocks
                for record in self._redis.encode_block(block.key, block.data)
            ]
            stored = await self._redis.put_records(records)
        finally:
            self._backlog_bytes -= nbytes
        if stored:
            self._stats.demotions += len(blocks)
            self._emit("stored", REDIS, [block.key for block in blocks])
        else:
            self._stats.demotions_dropped += len(blocks)

    def _emit(self, kind: EventKind, tier: str, keys: list[bytes]) -> None:
        event = BlockEvent(kind, self.instance, tier, keys)
        held = self._held.setdefault(tier, OrderedDict())
        for key in keys:
            if kind == "stored":
                held[key] = None
                held.move_to_end(key)
            else:
                held.pop(key, None)
        while len(held) > HELD_KEYS:
            held.popitem(last=False)
        self._events.append(event)
        if self._on_event is not None:
            self._on_event(event)


def _host_tier(
    layout: KvLayout, config: StoreConfig, clock: Callable[[], float], keep_evicted: bool
) -> HostTier:
    """The host tier `config` describes; `keep_evicted`: evicted blocks keep their data."""
    return HostTier(
        layout,
        config.host_capacity_bytes,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        pending_ttl_s=config.pending_ttl_s,
        keep_evicted_data=keep_evicted,
        clock=clock,
        shared=config.shared_arena,
    )


def _redis_tier(
    layout: KvLayout, config: StoreConfig, clock: Callable[[], float]
) -> RedisTier | None:
    """The Redis tier `config` describes, or None without a `redis_url`."""
    if not config.redis_url:
        return None
    key, password = config.redis_hmac_key, config.redis_password
    return RedisTier(
        config.redis_url,
        layout,
        ttl_s=config.redis_ttl_s,
        prefix=config.redis_prefix,
        timeout_s=config.redis_timeout_s,
        retry_interval_s=config.redis_retry_interval_s,
        clock=clock,
        hmac_key=key.get_secret_value().encode() if key else None,
        password=password.get_secret_value() if password else None,
        max_connections=config.redis_max_connections,
        pool_timeout_s=config.redis_pool_timeout_s,
    )
