"""Errors the KV store raises to its callers."""

from __future__ import annotations


class KvStoreError(Exception):
    """Base class of every KV store error."""


class CorruptRecord(KvStoreError, ValueError):
    """A stored or received record failed validation; it is treated as a miss."""


class StoreFull(KvStoreError):
    """Every block of the host tier is leased, so nothing can be evicted to make room."""

    def __init__(self, needed_blocks: int, evictable_blocks: int, leased_blocks: int) -> None:
        super().__init__(
            f"host tier needs {needed_blocks} free blocks but only {evictable_blocks} can be "
            f"evicted ({leased_blocks} are leased); release leases or raise host_capacity_bytes"
        )
        self.needed_blocks = needed_blocks
        self.evictable_blocks = evictable_blocks
        self.leased_blocks = leased_blocks

    def __reduce__(self):
        return (type(self), (self.needed_blocks, self.evictable_blocks, self.leased_blocks))


class LayerTimeout(KvStoreError):
    """`get_layer` gave up waiting for a layer of some blocks to be put."""

    def __init__(self, layer: int, missing_blocks: int, num_blocks: int, timeout_s: float) -> None:
        super().__init__(
            f"layer {layer}: {missing_blocks} of {num_blocks} blocks were not put within "
            f"{timeout_s:.3f} s; is the producer alive, or should timeout_s be longer?"
        )
        self.layer = layer
        self.missing_blocks = missing_blocks
        self.num_blocks = num_blocks
        self.timeout_s = timeout_s

    def __reduce__(self):
        return (type(self), (self.layer, self.missing_blocks, self.num_blocks, self.timeout_s))


class LayoutMismatch(KvStoreError, ValueError):
    """A buffer's shape or dtype does not match the store's KV layout."""
