"""A stored prefix read out of another node's store on the transfer engine
(kvstore/transfer/engine.py): the store node there leases the prefix's arena slots, and a
reader thread of this worker reads each layer of them into a buffer of its own, in layer
order, as soon as the load starts; the step thread takes each layer when that layer is about
to run, usually long after it came. No Ray object carries the prefix."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.transfer.engine import EngineArena, TransferEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemoteSlots:
    """A stored prefix's slots leased on another node's store (`lease_id`), in its arena as
    the engine reads it."""

    arena: EngineArena
    slots: list[int]
    lease_id: int


class RemotePrefix:
    """One load's reads: blocks in `slots` of `arena`, layer by layer into `buffer`
    (`[layer, k|v, block, ...]`, so each layer's K and V are contiguous here)."""

    def __init__(self, arena: EngineArena, slots: list[int], layout: KvLayout) -> None:
        self.arena = arena
        self.slots = slots
        self.page_bytes = layout.page_bytes
        shape = (layout.num_layers, 2, len(slots), *layout.page_shape)
        self.buffer = torch.empty(shape, dtype=layout.dtype)
        self.landed = [threading.Event() for _ in range(layout.num_layers)]
        self.error: Exception | None = None

    def pieces(self, layer: int) -> list[tuple[int, int, int]]:
        """(local, peer, bytes) of layer `layer`'s K and V of each block."""
        k, v = self.buffer[layer, 0], self.buffer[layer, 1]
        out = []
        for row, slot in enumerate(self.slots):
            at = self.arena.layer_at(slot, layer)
            out.append((k[row].data_ptr(), at, self.page_bytes))
            out.append((v[row].data_ptr(), at + self.page_bytes, self.page_bytes))
        return out

    def layers(self, timeout_s: float) -> list[LayerKV]:
        """Every layer, in order, once each has come (any thread)."""
        return [self.layer(layer, timeout_s) for layer in range(len(self.landed))]

    def layer(self, layer: int, timeout_s: float) -> LayerKV:
        """Step thread: layer `layer` once it has come (raises if its read failed)."""
        if not self.landed[layer].wait(timeout_s):
            raise TimeoutError(f"layer {layer} of a stored prefix did not come in {timeout_s} s")
        if self.error is not None:
            raise ConnectionError(f"reading a stored prefix failed: {self.error}")
        return LayerKV(self.buffer[layer, 0], self.buffer[layer, 1])


class PrefixReader:
    """The reader thread: each submitted load's layers, in order."""

    def __init__(self, endpoint: TransferEndpoint) -> None:
        self.endpoint = endpoint
        self.loads: queue.SimpleQueue = queue.SimpleQueue()
        self.num_layers_read = 0
        threading.Thread(target=self._read_forever, name="kv-prefix-reader", daemon=True).start()

    def submit(self, load: RemotePrefix) -> None:
        self.loads.put(load)

    def _read_forever(self) -> None:
        while True:
            load = self.loads.get()
            for layer, landed in enumerate(load.landed):
                try:
                    if load.error is None:
                        self.endpoint.read(load.arena.session, load.pieces(layer))
                        self.num_layers_read += 1
                except Exception as error:  # noqa: BLE001 - the step thread raises it
                    log.warning("reading a stored prefix from %s failed: %s", load.arena, error)
                    load.error = error
                finally:
                    landed.set()
