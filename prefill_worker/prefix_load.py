"""Prefix load: finding how much of a prompt the stores hold beyond this worker's own pages
(this node's host tier, then Redis; or another node's host tier when the router planned a
fetch from there: read on the transfer engine where both ends have one, remote_prefix.py),
and loading it into them layer by layer, each layer before that layer's compute; also the
hot-prefix warm-up (stored blocks adopted as cached pages)."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.transfer.engine import EngineArena, TransferEndpoint
from halfmoon.prefill_worker.job import ArenaSlots, Job, PrefixLoad
from halfmoon.prefill_worker.node_store import NodeStore
from halfmoon.prefill_worker.remote_prefix import PrefixReader, RemotePrefix, RemoteSlots

log = logging.getLogger(__name__)
REDIS = "redis"  # what a prefix loaded (in part) out of Redis is reported as
# Blocks warmed per engine call: bounds the memory in flight and the pause of the step loop.
WARM_CHUNK_BLOCKS = 64


class PrefixLoader:
    """Loads stored prefixes into the engine's pages (the engine asks through its KV hooks)."""

    def __init__(
        self,
        engine: LLMEngine,
        store: NodeStore,
        get_timeout_s: float,
        endpoint: TransferEndpoint | None = None,
    ) -> None:
        self.engine = engine
        self.kv_cache = engine.kv_cache
        self.layout = engine.kv_cache.layout
        self.store = store
        self.get_timeout_s = get_timeout_s
        # Other nodes' stores read on the transfer engine (remote_prefix.py), when there is one.
        self.reader = PrefixReader(endpoint) if endpoint is not None else None
        self.arenas: dict[str, EngineArena | None] = {}  # by store node name, asked once
        self.num_loaded_tokens = 0
        self.num_arena_loads = 0  # layers of stored prefixes copied out of the arena
        self.num_object_loads = 0  # layers of stored prefixes that came as Ray objects

    def counters(self) -> dict:
        return {
            "num_loaded_tokens": self.num_loaded_tokens,
            "num_arena_loads": self.num_arena_loads,
            "num_object_loads": self.num_object_loads,
            "num_engine_prefix_layers": self.reader.num_layers_read if self.reader else 0,
        }

    async def find(self, job: Job, fetch_from: str | None = None) -> None:
        """How many of the prompt's full blocks a store holds, leased there until `release`:
        this node's (host tier, then Redis: its arena slots when it maps here), or store node
        `fetch_from` on another node when the router planned a fetch from there and it holds
        more. Everything the step thread will need is asked for here, on the event loop."""
        prefix = job.prefix
        local = prefix.source = self.store.handle
        try:
            host, shared = await self._answer(local.prefix_depths.remote(job.block_keys))
        except (ray.exceptions.RayError, TimeoutError) as error:  # computed, never failed
            log.warning("looking a prefix up in this node's store failed: %s", error)
            return
        prefix.store_blocks = host + shared
        prefix.loaded_from = REDIS if shared else self.store.name
        try:
            await self._lease(job, fetch_from)
        except (ray.exceptions.RayError, TimeoutError) as error:
            log.warning("leasing a stored prefix failed (it is computed instead): %s", error)
            prefix.source, prefix.store_blocks = local, 0
            prefix.local_slots = prefix.remote_slots = None

    async def _lease(self, job: Job, fetch_from: str | None) -> None:
        """Lease the prefix where it is read from: another node's arena on the transfer
        engine, this node's arena, else the blocks (then read as Ray objects)."""
        prefix = job.prefix
        if fetch_from is not None and fetch_from != self.store.name:
            await self._find_remote(job, fetch_from)
        if prefix.source is self.store.handle:
            leased = await self._lease_local_slots(job)
        else:
            leased = await self._lease_remote_slots(job, fetch_from)
        if not leased and prefix.store_blocks:
            lease = prefix.source.lease.remote(job.block_keys[: prefix.store_blocks])
            prefix.lease_id = await self._answer(lease)

    async def _lease_local_slots(self, job: Job) -> bool:
        """Lease the prefix's slots in this node's arena when it maps here and holds all of
        it (each layer is then copied out of it, no Ray object per layer)."""
        prefix = job.prefix
        arena = await self.store.open()  # here, so the publisher never waits to map it
        if arena is None or not (prefix.store_blocks and job.arena_loads):
            return False
        keys = job.block_keys[: prefix.store_blocks]
        held = await self._answer(self.store.handle.lease_slots.remote(keys))
        if held is None:
            return False
        prefix.local_slots = ArenaSlots(arena, *held)
        prefix.lease_id = prefix.local_slots.lease_id
        return True

    async def _lease_remote_slots(self, job: Job, name: str) -> bool:
        """Lease the prefix's arena slots on store node `name` when both ends have a transfer
        engine and its host tier holds all of it (then it is read on the engine)."""
        prefix = job.prefix
        keys = job.block_keys[: prefix.store_blocks]
        prefix.remote_slots = await self._remote_slots(prefix.source, name, keys)
        if prefix.remote_slots is None:
            return False
        prefix.lease_id = prefix.remote_slots.lease_id
        return True

    async def _find_remote(self, job: Job, name: str) -> None:
        """Take store node `name`'s copy when it is deeper (a store that is gone is skipped:
        the prompt is then computed, never failed)."""
        try:
            remote = ray.get_actor(name)
            held = await asyncio.wait_for(
                remote.cached_prefix.remote(job.block_keys), self.get_timeout_s
            )
        except (ValueError, ray.exceptions.RayError, TimeoutError) as error:
            log.warning("fetching a prefix from store %s failed: %s", name, error)
            return
        prefix = job.prefix
        if held > prefix.store_blocks:
            prefix.source, prefix.store_blocks, prefix.loaded_from = remote, held, name

    def forget_store(self, name: str) -> None:
        """Store node `name` was replaced: ask the new one where its arena is."""
        self.arenas.pop(name, None)

    def release(self, job: Job) -> None:
        """The job ended: the loaded prefix is in our pages by now (or never will be)."""
        if job.prefix.lease_id is not None:
            job.prefix.source.release.remote(job.prefix.lease_id)

    def external_blocks(self, job: Job, first_block: int, max_blocks: int) -> int:
        return min(max_blocks, max(0, job.prefix.store_blocks - first_block))

    def start(self, job: Job, first_block: int, pages: list[int]) -> None:
        """Step thread: start loading blocks `first_block...` of the job into `pages` (from
        what `find` leased; the Ray object path only asks, its layers come as futures)."""
        prefix = job.prefix
        end = first_block + len(pages)
        if (leased := prefix.remote_slots) is not None:  # another node's arena, on the engine
            read = RemotePrefix(leased.arena, leased.slots[first_block:end], self.layout)
            self.reader.submit(read)
            prefix.load = PrefixLoad(first_block, pages, remote=read)
        elif (local := prefix.local_slots) is not None:
            slots = ArenaSlots(local.arena, local.slots[first_block:end], local.lease_id)
            prefix.load = PrefixLoad(first_block, pages, arena=slots)
        else:
            keys = job.block_keys[first_block:end]
            layers = [
                prefix.source.get_layer.remote(keys, layer, self.get_timeout_s).future()
                for layer in range(self.engine.facts.num_layers)
            ]
            prefix.load = PrefixLoad(first_block, pages, layers=layers)

    def before_layer(self, job: Job, layer: int) -> None:
        """Step thread: layer `layer` of the job's loading prefix lands in its pages now."""
        prefix = job.prefix
        if not prefix.started_at:
            prefix.started_at = time.time()
        load = prefix.load
        if load is None:
            return
        self.kv_cache.write_layer(layer, load.pages, self._layer(load, layer))
        if layer == self.engine.facts.num_layers - 1:
            loaded = len(load.pages) * self.engine.facts.block_size
            prefix.num_loaded_tokens += loaded
            self.num_loaded_tokens += loaded
            prefix.load = None

    def _layer(self, load: PrefixLoad, layer: int) -> LayerKV:
        """Step thread: layer `layer` of the load, once it is here."""
        if load.arena is not None:
            cuda = self.kv_cache.device.type == "cuda"
            self.num_arena_loads += 1
            return load.arena.arena.read(load.arena.slots, layer, pin=cuda)
        if load.remote is not None:
            return load.remote.layer(layer, self.get_timeout_s)
        self.num_object_loads += 1
        # The store waits up to get_timeout_s for the layer; this, for a store that hangs.
        return load.layers[layer].result(timeout=2 * self.get_timeout_s)

    async def warm(
        self, engine: AsyncEngine, block_keys: list[bytes], store, name: str | None = None
    ) -> int:
        """Adopt the stored blocks of the chain `block_keys` from `store` (store node `name`)
        that this engine does not cache yet; returns how many were added. Another node's
        store is read on the transfer engine when both ends have one."""
        keys = await engine.run(lambda e: e.uncached(list(block_keys)))
        held = await self._answer(store.cached_prefix.remote(keys))
        if not held:
            return 0
        leased = None
        if name is not None and name != self.store.name:
            leased = await self._remote_slots(store, name, keys[:held])
        if leased is None:
            lease_id = await self._answer(store.lease.remote(keys[:held]))
        else:
            lease_id = leased.lease_id
        adopted = 0
        try:
            for first in range(0, held, WARM_CHUNK_BLOCKS):
                chunk = keys[first : min(first + WARM_CHUNK_BLOCKS, held)]
                if leased is None:
                    layers = await self._object_layers(store, chunk)
                else:
                    layers = await self._engine_layers(leased, first, len(chunk))
                adopted += await engine.run(lambda e, c=chunk, kv=layers: e.adopt_blocks(c, kv))
        finally:
            store.release.remote(lease_id)
        return adopted

    async def _remote_slots(self, store, name: str, keys: list[bytes]) -> RemoteSlots | None:
        """`keys` leased in another node's store `name` to read on the engine; None when
        either end has no engine or its host tier lacks some of them (then Ray objects)."""
        if self.reader is None:
            return None
        if name not in self.arenas:
            self.arenas[name] = await self._answer(store.engine_arena.remote())
        if self.arenas[name] is None:
            return None
        held = await self._answer(store.lease_slots.remote(keys))
        return None if held is None else RemoteSlots(self.arenas[name], *held)

    async def _answer(self, ref):
        """A store node's answer, waited for at most `get_timeout_s`."""
        return await asyncio.wait_for(ref, self.get_timeout_s)

    async def _object_layers(self, store, chunk: list[bytes]) -> list[LayerKV]:
        num_layers = self.engine.facts.num_layers
        gets = [
            store.get_layer.remote(chunk, layer, self.get_timeout_s) for layer in range(num_layers)
        ]
        self.num_object_loads += num_layers
        return await asyncio.gather(*gets)

    async def _engine_layers(self, leased: RemoteSlots, first: int, count: int) -> list[LayerKV]:
        read = RemotePrefix(leased.arena, leased.slots[first : first + count], self.layout)
        self.reader.submit(read)
        return await asyncio.to_thread(read.layers, self.get_timeout_s)
