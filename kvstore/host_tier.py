"""Host tier: a fixed arena of block slots with LRU eviction, watermarks and leases."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from halfmoon.kvstore.errors import StoreFull
from halfmoon.kvstore.eviction import LruEviction
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.leases import LeaseTable
from halfmoon.kvstore.shared_arena import copy_in, copy_out, create_arena, slot_pages


@dataclass(slots=True)
class EvictedBlock:
    """A block leaving the host tier; `data` holds every layer's K and V if it was complete."""

    key: bytes
    data: torch.Tensor | None


@dataclass(slots=True)
class WriteResult:
    """Blocks that became complete (every layer present) and blocks evicted by one write."""

    completed: list[bytes] = field(default_factory=list)
    evicted: list[EvictedBlock] = field(default_factory=list)


@dataclass(slots=True)
class HostUsage:
    """Occupancy of the host tier."""

    capacity_blocks: int
    used_blocks: int
    complete_blocks: int
    leased_blocks: int
    used_bytes: int
    capacity_bytes: int


class HostTier:
    """Block slots of `layout.block_bytes` each, preallocated in one uint8 tensor.

    A slot is taken when a block's first layer is put and stays leased ("pending") until
    its last layer arrives or `pending_ttl_s` passes, so a half-written block is not evicted
    under its producer.
    """

    def __init__(
        self,
        layout: KvLayout,
        capacity_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        pending_ttl_s: float = 60.0,
        keep_evicted_data: bool = False,
        clock: Callable[[], float] = time.monotonic,
        shared: bool = False,
    ) -> None:
        num_slots = capacity_bytes // layout.block_bytes
        if num_slots < 1:
            raise ValueError(
                f"host capacity of {capacity_bytes} bytes holds no block of "
                f"{layout.block_bytes} bytes; raise host_capacity_bytes"
            )
        self.layout = layout
        self.num_slots = num_slots
        self.high_slots = max(1, int(high_watermark * num_slots))
        self.low_slots = min(self.high_slots, int(low_watermark * num_slots))
        self.pending_ttl_s = pending_ttl_s
        self.keep_evicted_data = keep_evicted_data
        self.num_evictions = 0
        # Shared: producers on this node write layers into it themselves (`claim`/`written`).
        made = create_arena(num_slots * layout.block_bytes) if shared else None
        self.arena_path = made[1] if made else None
        arena = made[0] if made else torch.empty(num_slots * layout.block_bytes, dtype=torch.uint8)
        self._arena = arena.view(num_slots, layout.block_bytes)
        self._pages = slot_pages(arena, layout, num_slots)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[bytes, int] = {}
        self._present = np.zeros((num_slots, layout.num_layers), dtype=bool)
        self._num_present = np.zeros(num_slots, dtype=np.int32)
        self._lru = LruEviction()
        self._leases = LeaseTable(self._lru, clock)
        self._pending: dict[bytes, int] = {}

    def memory(self) -> tuple[int, int]:
        """The arena's address and size in bytes (for a transfer engine to register)."""
        return self._arena.data_ptr(), self._arena.numel()

    def __contains__(self, key: object) -> bool:
        """Whether every layer of block `key` is present."""
        slot = self._slots.get(key)  # type: ignore[call-overload]
        return slot is not None and self._num_present[slot] == self.layout.num_layers

    def has_layer(self, key: bytes, layer: int) -> bool:
        slot = self._slots.get(key)
        return slot is not None and bool(self._present[slot, layer])

    def missing(self, keys: Sequence[bytes], layer: int) -> list[int]:
        """Indices into `keys` of blocks whose `layer` is not present."""
        return [i for i, key in enumerate(keys) if not self.has_layer(key, layer)]

    def leading_complete(self, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` are present with every layer."""
        count = 0
        for key in keys:
            if key not in self:
                break
            count += 1
        return count

    def write_layer(self, keys: Sequence[bytes], layer: int, kv: LayerKV) -> WriteResult:
        """Copy one layer of `keys` into their slots, taking and evicting slots as needed."""
        self._check_layer(layer)
        kv.check(self.layout, len(keys))
        _, result = self._slots_for(keys)
        copy_in(self._pages, [self._slots[key] for key in keys], layer, kv)
        for key in keys:
            self._lru.add(key)
            if self._mark_present(key, layer):
                result.completed.append(key)
        result.evicted += self._evict(len(self._slots) - self.low_slots, self.high_slots)
        return result

    def claim(self, keys: Sequence[bytes], ttl_s: float) -> tuple[list[int], int, WriteResult]:
        """Slots for a producer that copies the layers of `keys` into the shared arena itself:
        (slot of each key, a lease that keeps them from eviction until released or `ttl_s`,
        and what taking the slots evicted). The producer then calls `written` per layer."""
        batch, result = self._slots_for(keys)
        lease_id = self._leases.grant(batch, ttl_s)
        for key in batch:
            self._lru.add(key)
        result.evicted += self._evict(len(self._slots) - self.low_slots, self.high_slots)
        return [self._slots[key] for key in keys], lease_id, result

    def _slots_for(self, keys: Sequence[bytes]) -> tuple[list[bytes], WriteResult]:
        """Take a slot for each of `keys` without one, evicting as needed: the distinct keys
        and what was evicted."""
        self._leases.expire()
        result = WriteResult()
        batch = list(dict.fromkeys(keys))
        new_keys = [key for key in batch if key not in self._slots]
        result.evicted = self._make_room(len(new_keys), [k for k in batch if k in self._slots])
        for key in new_keys:
            self._take_slot(key)
        return batch, result

    def written(self, keys: Sequence[bytes], layer: int, slots: Sequence[int]) -> WriteResult:
        """A producer copied `layer` of `keys` into `slots` (from `claim`): mark it present.
        A key whose slot changed meanwhile (its claim expired) is skipped."""
        self._check_layer(layer)
        result = WriteResult()
        for key, slot in zip(keys, slots, strict=True):
            if self._slots.get(key) != slot:
                continue
            self._lru.add(key)
            if self._mark_present(key, layer):
                result.completed.append(key)
        return result

    def slots_of(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of present blocks `keys` (for a reader of the shared arena)."""
        for key in keys:
            self._lru.add(key)
        return [self._slots[key] for key in keys]

    def read_layer(self, keys: Sequence[bytes], layer: int) -> LayerKV:
        """Copy one layer of `keys` out of their slots; every block must hold that layer."""
        self._check_layer(layer)
        absent = self.missing(keys, layer)
        if absent:
            raise KeyError(f"layer {layer} of {len(absent)} blocks is not in the host tier")
        return copy_out(self._pages, self.slots_of(keys), layer)

    def lease(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Lease the present blocks of `keys` for `ttl_s` seconds; return the lease id."""
        self._leases.expire()
        return self._leases.grant(keys, ttl_s)

    def extend_lease(self, lease_id: int, keys: Sequence[bytes]) -> None:
        """Add blocks that have since arrived to a live lease."""
        self._leases.extend(lease_id, keys)

    def release(self, lease_id: int) -> bool:
        """Release a lease; False when it had already expired or been released."""
        return self._leases.release(lease_id)

    def expire_leases(self) -> int:
        """Release the leases whose time is up now (a grant does it too); returns how many."""
        return self._leases.expire()

    def usage(self) -> HostUsage:
        complete = int(np.count_nonzero(self._num_present == self.layout.num_layers))
        return HostUsage(
            capacity_blocks=self.num_slots,
            used_blocks=len(self._slots),
            complete_blocks=complete,
            leased_blocks=self._lru.num_leased,
            used_bytes=len(self._slots) * self.layout.block_bytes,
            capacity_bytes=self.num_slots * self.layout.block_bytes,
        )

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.layout.num_layers - 1}")

    def _take_slot(self, key: bytes) -> None:
        self._slots[key] = self._free.pop()
        self._lru.add(key)
        self._pending[key] = self._leases.grant([key], self.pending_ttl_s)

    def _mark_present(self, key: bytes, layer: int) -> bool:
        """Record `layer` of `key` as present; True when that completes the block."""
        slot = self._slots[key]
        if self._present[slot, layer]:
            return False
        self._present[slot, layer] = True
        self._num_present[slot] += 1
        if self._num_present[slot] < self.layout.num_layers:
            return False
        self._leases.release(self._pending.pop(key))
        return True

    def _make_room(self, num_new: int, keep: list[bytes]) -> list[EvictedBlock]:
        """Free slots for `num_new` blocks without evicting the blocks in `keep`."""
        shortfall = num_new - len(self._free)
        if shortfall <= 0:
            return []
        lease_id = self._leases.grant(keep, 0.0)
        try:
            evictable = len(self._lru) - self._lru.num_leased
            if evictable < shortfall:
                raise StoreFull(num_new, evictable + len(self._free), self._lru.num_leased)
            return self._evict(shortfall, 0)
        finally:
            self._leases.release(lease_id)

    def _evict(self, num_blocks: int, above: int) -> list[EvictedBlock]:
        """Evict up to `num_blocks` LRU blocks, but only while more than `above` slots are used."""
        if len(self._slots) <= above:
            return []
        evicted: list[EvictedBlock] = []
        for _ in range(num_blocks):
            key = self._lru.pop_victim()
            if key is None:
                break
            evicted.append(self._drop(key))
        self.num_evictions += len(evicted)
        return evicted

    def _drop(self, key: bytes) -> EvictedBlock:
        slot = self._slots.pop(key)
        complete = self._num_present[slot] == self.layout.num_layers
        data = self._arena[slot].clone() if complete and self.keep_evicted_data else None
        self._present[slot] = False
        self._num_present[slot] = 0
        self._pending.pop(key, None)
        self._free.append(slot)
        return EvictedBlock(key, data)
