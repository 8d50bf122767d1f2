"""The per-node store as a Ray actor: a thin async wrapper over KvStore."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.metrics_endpoint import actor_registry, serve_actor_metrics
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.kvstore.shared_arena import ArenaInfo
from halfmoon.kvstore.store import KvStore

# A read waits inside the actor until its layer is put, holding one of the actor's call slots;
# a put that finds every slot taken would wait for a read to time out, and the reads wait for
# that put: a stall of `get_timeout_s`. A decode worker reads a whole prompt through one
# stream (one slot), so the slots bound the requests receiving from this node at once, far
# above what its decode workers' pages can hold. Waiting coroutines cost a few KB each.
MAX_CONCURRENT_CALLS = 100_000


def _forward(method: Callable) -> Callable:
    """An async actor method that calls KvStore `method` on `self.store` (same signature)."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        async def call(self, *args, **kwargs):
            async for item in getattr(self.store, name)(*args, **kwargs):
                yield item

    elif inspect.iscoroutinefunction(method):

        async def call(self, *args, **kwargs):
            return await getattr(self.store, name)(*args, **kwargs)

    else:

        async def call(self, *args, **kwargs):
            return getattr(self.store, name)(*args, **kwargs)

    return functools.wraps(method)(call)


class StoreNode:
    """KvStore as an actor, every method async; run it with `start_store_node` (one per node).
    Call `stream_layers` and `stream_slots` with `.options(num_returns="streaming")`."""

    def __init__(self, layout: KvLayout, config: StoreConfig, instance: str) -> None:
        # Copies are memory-bound; extra intra-op threads only contend with the workers.
        torch.set_num_threads(1)
        self.store = KvStore(layout, config, instance)
        self.metrics_address: str | None = None
        freeze_startup_heap(f"store node {instance}")

    put_layer = _forward(KvStore.put_layer)
    claim = _forward(KvStore.claim)
    layer_written = _forward(KvStore.layer_written)
    get_layer = _forward(KvStore.get_layer)
    stream_layers = _forward(KvStore.stream_layers)
    stream_slots = _forward(KvStore.stream_slots)
    end_stream = _forward(KvStore.end_stream)
    lease_slots = _forward(KvStore.lease_slots)
    cached_prefix = _forward(KvStore.cached_prefix)
    prefix_depths = _forward(KvStore.prefix_depths)
    lease = _forward(KvStore.lease)
    release = _forward(KvStore.release)
    drain_events = _forward(KvStore.drain_events)
    stats = _forward(KvStore.stats)
    close = _forward(KvStore.close)

    async def arena_info(self) -> ArenaInfo | None:
        """Where producers on this node map the host tier's arena (None: not shared)."""
        path = self.store.host.arena_path
        if path is None:
            return None
        node_id = ray.get_runtime_context().get_node_id()
        return ArenaInfo(path, node_id, self.store.host.num_slots, self.store.layout)

    async def release_many(self, lease_ids: Sequence[int]) -> int:
        """Release several leases in one call; returns how many were still held."""
        return sum(self.store.release(lease_id) for lease_id in lease_ids)

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
