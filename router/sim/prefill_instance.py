"""A simulated prefill instance: a FIFO of prefills timed by the cost model, over a block
cache that is a real LruEviction publishing stored/evicted events to the PrefixIndex."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from halfmoon.kvstore.eviction import LruEviction
from halfmoon.router.prefix_index import PrefixIndex

CACHE_TIER = "host"


@dataclass(slots=True)
class PrefillJob:
    """One request waiting for (or running) prefill here."""

    request_id: str
    keys: Sequence[Hashable]
    num_prompt_tokens: int
    source: SimPrefill | None
    source_blocks: int
    local_leased: int
    work_s: float = 0.0
    cached_tokens: int = 0


@dataclass(slots=True)
class PrefillRun:
    """What a started prefill will do: its cached prefix, fetch and predicted compute."""

    job: PrefillJob
    cached_blocks: int
    cached_tokens: int
    fetch_tokens: int


class SimPrefill:
    """One prefill instance: its queue and its cache of `capacity_blocks` blocks."""

    def __init__(self, name: str, capacity_blocks: int, index: PrefixIndex) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.index = index
        self.cache = LruEviction()
        self.queue: deque[PrefillJob] = deque()
        self.running: PrefillRun | None = None

    def prefix_depth(self, keys: Sequence[Hashable]) -> int:
        """Leading blocks of `keys` this instance holds."""
        depth = 0
        cache = self.cache
        for key in keys:
            if key not in cache:
                break
            depth += 1
        return depth

    def lease(self, keys: Sequence[Hashable], depth: int) -> None:
        """Pin the first `depth` blocks until a queued prefill has read them."""
        for key in keys[:depth]:
            self.cache.lease(key)

    def release(self, keys: Sequence[Hashable], depth: int) -> None:
        """Unpin what `lease` pinned."""
        for key in keys[:depth]:
            self.cache.release(key)

    def store(self, keys: Sequence[Hashable]) -> None:
        """Keep the blocks of a finished prefill, evicting LRU ones past capacity."""
        cache = self.cache
        stored = []
        for key in keys:
            if key not in cache:
                stored.append(key)
            cache.add(key)  # a known block becomes the most recently used
        evicted = []
        while len(cache) > self.capacity_blocks:
            victim = cache.pop_victim()
            if victim is None:
                break
            evicted.append(victim)
        if stored:
            self.index.stored(self.name, CACHE_TIER, stored)
        if evicted:
            self.index.evicted(self.name, CACHE_TIER, evicted)
