"""Per-request layer streams over a BlockStore: reads that wait for layers still being put.

The transfer's part of the store node: a decode worker reads a whole prompt, unit by unit and
layer by layer, through one stream, and ends it (done, aborted or failed) by its stream id.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

from halfmoon.kvstore.blocks import BlockStore
from halfmoon.kvstore.errors import LayerTimeout
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.stats import LatencyStats

# `stream_slots` streams tracked, open or ended (beyond it, the oldest are ended and forgotten).
MAX_STREAMS = 131072


class LayerStreams:
    """Layer-wise reads of `blocks` that wait for each layer to be put; one loop, as BlockStore."""

    def __init__(self, blocks: BlockStore) -> None:
        self._blocks = blocks
        self._config = blocks.config
        self._latency = LatencyStats()
        # By stream id: the leases a `stream_slots` stream holds, None once it ended.
        self._streams: OrderedDict[str, list[int] | None] = OrderedDict()

    async def get_layer(
        self, keys: Sequence[bytes], layer: int, timeout_s: float | None = None
    ) -> LayerKV:
        """One layer of `keys`; waits up to `timeout_s` for blocks not yet put, or LayerTimeout."""
        start = time.perf_counter()
        async with self._layer_ready(keys, layer, timeout_s):
            kv = self._blocks.read_layer(keys, layer)
        self._latency.record(time.perf_counter() - start)
        return kv

    async def stream_layers(
        self, units: Sequence[Sequence[bytes]], num_layers: int, timeout_s: float | None = None
    ) -> AsyncIterator[LayerKV]:
        """Every layer of every unit of blocks, unit by unit and layer by layer, each as soon
        as it is put: `get_layer` in that order, each waiting up to `timeout_s`."""
        for keys in units:
            for layer in range(num_layers):
                yield await self.get_layer(keys, layer, timeout_s)

    async def stream_slots(
        self,
        units: Sequence[Sequence[bytes]],
        num_layers: int,
        timeout_s: float | None = None,
        stream_id: str = "",
    ) -> AsyncIterator[tuple[list[int], int]]:
        """`stream_layers` for a reader that maps the shared arena: each item is the unit's
        slots and a lease holding them, until `end_stream(stream_id)` (or `lease_ttl_s`)."""
        if stream_id in self._streams and self._streams[stream_id] is None:
            return  # its reader ended it before it began
        holds = self._streams.setdefault(stream_id, [])
        self._forget_oldest()
        for keys in units:
            for layer in range(num_layers):
                start = time.perf_counter()
                async with self._layer_ready(keys, layer, timeout_s):
                    if self._streams.get(stream_id) is not holds:
                        return  # its reader gave up while this layer was awaited
                    slots, lease_id = self._blocks.lease_layer(keys)
                    holds.append(lease_id)
                self._latency.record(time.perf_counter() - start)
                yield slots, lease_id

    def end_stream(self, stream_id: str) -> None:
        """Release every lease a `stream_slots` stream granted, items sent ahead included; it
        grants no more."""
        holds = self._streams.pop(stream_id, None)
        self._streams[stream_id] = None
        self._release(holds)
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        while len(self._streams) > MAX_STREAMS:
            _, holds = self._streams.popitem(last=False)
            self._release(holds)

    def _release(self, leases: list[int] | None) -> None:
        for lease_id in leases or ():
            self._blocks.release(lease_id)

    def latency(self) -> LatencyStats:
        """Latency of the layer-wise reads so far, waits included."""
        return copy.copy(self._latency)

    @contextlib.asynccontextmanager
    async def _layer_ready(
        self, keys: Sequence[bytes], layer: int, timeout_s: float | None
    ) -> AsyncIterator[None]:
        """Inside: every block of `keys` holds `layer` (promoted from Redis where it can be,
        waited for up to `timeout_s` otherwise, or LayerTimeout), leased."""
        timeout_s = self._config.get_timeout_s if timeout_s is None else timeout_s
        await self._blocks.fetch_layer(keys, layer)
        lease_id = self._blocks.lease(keys, max(timeout_s, self._config.lease_ttl_s))
        try:
            await self._wait_for(keys, layer, lease_id, timeout_s)
            yield
        finally:
            self._blocks.release(lease_id)

    async def _wait_for(
        self, keys: Sequence[bytes], layer: int, lease_id: int, timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while missing := self._blocks.missing(keys, layer):
            self._blocks.extend_lease(lease_id, keys)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise LayerTimeout(layer, len(missing), len(keys), timeout_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._blocks.next_arrival(layer).wait(), remaining)
