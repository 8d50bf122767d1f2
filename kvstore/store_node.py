"""The per-node store as a Ray actor: a thin async wrapper over KvStore."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.index import BlockEvent
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.metrics_endpoint import actor_registry, serve_actor_metrics
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.kvstore.shared_arena import ArenaInfo
from halfmoon.kvstore.stats import StoreStats
from halfmoon.kvstore.store import KvStore, PrefixHit

# A read waits inside the actor until its layer is put, holding one of the actor's call slots;
# a put that finds every slot taken would wait for a read to time out, and the reads wait for
# that put: a stall of `get_timeout_s`. A decode worker reads a whole prompt through one
# stream (one slot), so the slots bound the requests receiving from this node at once, far
# above what its decode workers' pages can hold. Waiting coroutines cost a few KB each.
MAX_CONCURRENT_CALLS = 100_000


class StoreNode:
    """Every method mirrors KvStore; run it with `start_store_node` (one per Ray node)."""

    def __init__(self, layout: KvLayout, config: StoreConfig, instance: str) -> None:
        # Copies are memory-bound; extra intra-op threads only contend with the workers.
        torch.set_num_threads(1)
        self.store = KvStore(layout, config, instance)
        self.metrics_address: str | None = None
        freeze_startup_heap(f"store node {instance}")

    async def put_layer(self, keys: Sequence[bytes], layer: int, kv: LayerKV) -> None:
        await self.store.put_layer(keys, layer, kv)

    async def arena_info(self) -> ArenaInfo | None:
        """Where producers on this node map the host tier's arena (None: not shared)."""
        path = self.store.host.arena_path
        if path is None:
            return None
        node_id = ray.get_runtime_context().get_node_id()
        return ArenaInfo(path, node_id, self.store.host.num_slots, self.store.layout)

    async def claim(self, keys: Sequence[bytes]) -> tuple[list[int], int]:
        return self.store.claim(keys)

    async def lease_slots(self, keys: Sequence[bytes]) -> tuple[list[int], int] | None:
        return self.store.lease_slots(keys)

    async def layer_written(
        self,
        keys: Sequence[bytes],
        layer: int | Sequence[int],
        slots: Sequence[int],
        release_lease: int | None = None,
    ) -> None:
        await self.store.layer_written(keys, layer, slots, release_lease)

    async def get_layer(
        self, keys: Sequence[bytes], layer: int, timeout_s: float | None = None
    ) -> LayerKV:
        return await self.store.get_layer(keys, layer, timeout_s)

    async def stream_layers(
        self, units: Sequence[Sequence[bytes]], num_layers: int, timeout_s: float | None = None
    ) -> AsyncIterator[LayerKV]:
        """Call with `.options(num_returns="streaming")`; `ray.cancel` it to stop early."""
        async for kv in self.store.stream_layers(units, num_layers, timeout_s):
            yield kv

    async def stream_slots(
        self,
        units: Sequence[Sequence[bytes]],
        num_layers: int,
        timeout_s: float | None = None,
        stream_id: str = "",
    ) -> AsyncIterator[tuple[list[int], int]]:
        """`stream_layers` for readers that map the arena (`arena_info`): (slots, lease) per
        unit and layer; call `end_stream(stream_id)` once the reader copies no more."""
        async for item in self.store.stream_slots(units, num_layers, timeout_s, stream_id):
            yield item

    async def end_stream(self, stream_id: str) -> None:
        self.store.end_stream(stream_id)

    async def lookup(self, keys: Sequence[bytes]) -> PrefixHit:
        return await self.store.lookup(keys)

    async def cached_prefix(self, keys: Sequence[bytes]) -> int:
        return self.store.cached_prefix(keys)

    async def lease(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        return self.store.lease(keys, ttl_s)

    async def release(self, lease_id: int) -> bool:
        return self.store.release(lease_id)

    async def release_many(self, lease_ids: Sequence[int]) -> int:
        """Release several leases in one call; returns how many were still held."""
        return sum(self.store.release(lease_id) for lease_id in lease_ids)

    async def drain_events(self) -> list[BlockEvent]:
        return self.store.drain_events()

    async def stats(self) -> StoreStats:
        return self.store.stats()

    async def flush(self) -> None:
        await self.store.flush()

    async def close(self) -> None:
        await self.store.close()

    async def serve_metrics(self, host: str) -> str:
        """Serve this process's /metrics (CPU, memory: the host tier lives here) on a free port
        of `host` (once); returns host:port. The tier figures are on the router's /metrics."""
        if self.metrics_address is None:
            self.metrics_server, self.metrics_address = serve_actor_metrics(actor_registry(), host)
        return self.metrics_address


def store_node_name(node_id: str) -> str:
    """The actor name of the store node on Ray node `node_id`."""
    return f"halfmoon-kvstore-{node_id}"


def start_store_node(
    layout: KvLayout,
    config: StoreConfig | None = None,
    node_id: str | None = None,
    name: str | None = None,
) -> ray.actor.ActorHandle:
    """Start (or find) the store node on `node_id` (default: this node), named after it."""
    node_id = node_id or ray.get_runtime_context().get_node_id()
    name = name or store_node_name(node_id)
    actor = ray.remote(StoreNode).options(
        name=name,
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=MAX_CONCURRENT_CALLS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )
    return actor.remote(layout, config or StoreConfig(), name)
