"""The per-node store as a Ray actor: the block store and the layer streams over it."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from halfmoon.kvstore.blocks import BlockStore
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.metrics_endpoint import actor_registry, serve_actor_metrics
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.kvstore.shared_arena import ArenaInfo
from halfmoon.kvstore.stats import StoreStats
from halfmoon.kvstore.streams import LayerStreams
from halfmoon.kvstore.transfer.engine import EngineArena, open_endpoint

# A read waits inside the actor until its layer is put, holding one of the actor's call slots;
# a put that finds every slot taken would wait for a read to time out, and the reads wait for
# that put: a stall of `get_timeout_s`. A decode worker reads a whole prompt through one
# stream (one slot), so the slots bound the requests receiving from this node at once, far
# above what its decode workers' pages can hold. Waiting coroutines cost a few KB each.
MAX_CONCURRENT_CALLS = 100_000


def _forward(part: str, method: Callable) -> Callable:
    """An async actor method that calls `method` on the node's `part` (same signature)."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        async def call(self, *args, **kwargs):
            async for item in getattr(getattr(self, part), name)(*args, **kwargs):
                yield item

    elif inspect.iscoroutinefunction(method):

        async def call(self, *args, **kwargs):
            return await getattr(getattr(self, part), name)(*args, **kwargs)

    else:

        async def call(self, *args, **kwargs):
            return getattr(getattr(self, part), name)(*args, **kwargs)

    return functools.wraps(method)(call)


class StoreNode:
    """The node's BlockStore and LayerStreams as an actor, every method async; run it with
    `start_store_node` (one per node). Call the streams with `.options(num_returns="streaming")`."""

    def __init__(self, layout: KvLayout, config: StoreConfig, instance: str) -> None:
        # Copies are memory-bound; extra intra-op threads only contend with the workers.
        torch.set_num_threads(1)
        self.blocks = BlockStore(layout, config, instance)
        self.streams = LayerStreams(self.blocks)
        self.metrics_address: str | None = None
        # Prefill workers on other nodes read stored prefixes out of the arena on the engine.
        self.endpoint, self.transfer_path = open_endpoint(config.transfer)
        if self.endpoint is not None:
            self.endpoint.register(*self.blocks.arena_memory())
        freeze_startup_heap(f"store node {instance}")

    put_layer = _forward("blocks", BlockStore.put_layer)
    claim = _forward("blocks", BlockStore.claim)
    layer_written = _forward("blocks", BlockStore.layer_written)
    lease_slots = _forward("blocks", BlockStore.lease_slots)
    cached_prefix = _forward("blocks", BlockStore.cached_prefix)
    prefix_depths = _forward("blocks", BlockStore.prefix_depths)
    lease = _forward("blocks", BlockStore.lease)
    release = _forward("blocks", BlockStore.release)
    drain_events = _forward("blocks", BlockStore.drain_events)
    snapshot = _forward("blocks", BlockStore.snapshot)
    close = _forward("blocks", BlockStore.close)
    get_layer = _forward("streams", LayerStreams.get_layer)
    stream_layers = _forward("streams", LayerStreams.stream_layers)
    stream_slots = _forward("streams", LayerStreams.stream_slots)
    end_stream = _forward("streams", LayerStreams.end_stream)

    def __ray_shutdown__(self) -> None:
        """On a graceful exit: peers may no longer read the arena."""
        if self.endpoint is not None:
            self.endpoint.close()

    async def engine_arena(self) -> EngineArena | None:
        """Where peers on other nodes read this node's arena on the transfer engine (None:
        there is no engine here, and they read stored layers as Ray objects)."""
        if self.endpoint is None:
            return None
        layout = self.blocks.layout
        base, num_bytes = self.blocks.arena_memory()
        session = self.endpoint.session
        num_slots = num_bytes // layout.block_bytes
        return EngineArena(session, base, num_slots, layout.block_bytes, layout.layer_bytes)

    async def stats(self) -> StoreStats:
        """The block store's snapshot, with the latency of the streams' reads."""
        return replace(self.blocks.stats(), get_latency=self.streams.latency())

    async def arena_info(self) -> ArenaInfo | None:
        """Where producers on this node map the host tier's arena (None: not shared)."""
        return self.blocks.arena_info(ray.get_runtime_context().get_node_id())

    async def ping(self) -> str:
        """Its name: the controller's liveness check."""
        return self.blocks.instance

    async def release_many(self, lease_ids: Sequence[int]) -> int:
        """Release several leases in one call; returns how many were still held."""
        return sum(self.blocks.release(lease_id) for lease_id in lease_ids)

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
