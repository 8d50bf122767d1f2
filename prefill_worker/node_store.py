"""This node's store actor, as the prefill worker's publisher and prefix load reach it."""

from __future__ import annotations

import asyncio
import logging

import ray

from halfmoon.kvstore.locate import local_store, local_store_name
from halfmoon.kvstore.shared_arena import ArenaInfo, MappedArena, map_arena

log = logging.getLogger(__name__)


class NodeStore:
    """The store actor (found on first use: it is started after the workers) and its shared
    arena, mapped once (None: it is elsewhere or private, and layers travel as Ray objects);
    `timeout_s`: the longest a call to it is waited for (a hung store holds no thread)."""

    def __init__(self, handle=None, timeout_s: float = 30.0) -> None:
        self._handle = handle
        self.timeout_s = timeout_s
        self._arena: MappedArena | None = None
        self._checked = False

    def reset(self) -> None:
        """The store node was replaced: find the new one (and map its arena) on next use;
        calls in flight on the old one fail and their requests are retried."""
        self._handle, self._arena, self._checked = None, None, False

    @property
    def name(self) -> str:
        """The actor name of this node's store node (how the router's index names it)."""
        return local_store_name()

    @property
    def handle(self):
        if self._handle is None:
            self._handle = local_store()
        return self._handle

    async def open(self) -> MappedArena | None:
        """Event loop: the arena, asked for without blocking the loop the first time."""
        if not self._checked:
            self._map(await asyncio.wait_for(self.handle.arena_info.remote(), self.timeout_s))
        return self._arena

    def arena(self) -> MappedArena | None:
        """Publisher thread: the arena (asked for, waiting, if `open` has not been yet)."""
        if not self._checked:
            self._map(ray.get(self.handle.arena_info.remote(), timeout=self.timeout_s))
        return self._arena

    def _map(self, info: ArenaInfo | None) -> None:
        self._arena = map_arena(info, ray.get_runtime_context().get_node_id())
        self._checked = True  # after `_arena`: a thread seeing it sees the arena too
        log.info(
            "KV layers go to the store %s",
            "through shared memory" if self._arena else "as Ray objects",
        )
