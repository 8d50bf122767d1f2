"""Errors the KV store raises to its callers."""

from __future__ import annotations

from dataclasses import astuple, dataclass, is_dataclass


class KvStoreError(Exception):
    """Base class of every KV store error."""

    def __reduce__(self):
        # Rebuilt from its fields however it was built (Exception pickles positional args only).
        return (type(self), astuple(self) if is_dataclass(self) else self.args)


class CorruptRecord(KvStoreError, ValueError):
    """A stored or received record failed validation; it is treated as a miss."""


@dataclass(eq=False)
class StoreFull(KvStoreError):
    """Every block of the host tier is leased, so nothing can be evicted to make room."""

    needed_blocks: int
    evictable_blocks: int
    leased_blocks: int

    def __str__(self) -> str:
        return (
            f"host tier needs {self.needed_blocks} free blocks but only {self.evictable_blocks} "
            f"can be evicted ({self.leased_blocks} are leased); release leases or raise "
            "host_capacity_bytes"
        )


@dataclass(eq=False)
class LayerTimeout(KvStoreError):
    """`get_layer` gave up waiting for a layer of some blocks to be put."""

    layer: int
    missing_blocks: int
    num_blocks: int
    timeout_s: float

    def __str__(self) -> str:
        return (
            f"layer {self.layer}: {self.missing_blocks} of {self.num_blocks} blocks were not put "
            f"within {self.timeout_s:.3f} s; is the producer alive, or should timeout_s be longer?"
        )


class LayoutMismatch(KvStoreError, ValueError):
    """A buffer's shape or dtype does not match the store's KV layout."""
