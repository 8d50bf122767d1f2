"""Least-recently-used eviction order over block keys, with ref-counted leases."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class LruEviction:
    """Tracks keys least recent first; a leased key is never chosen as a victim.

    Leased keys leave the LRU order and rejoin it as most recent on their last release,
    so every operation is O(1).
    """

    __slots__ = ("_order", "_leases")

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._leases: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self._order) + len(self._leases)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._leases

    @property
    def num_leased(self) -> int:
        """Number of tracked keys holding at least one lease."""
        return len(self._leases)

    def add(self, key: Hashable) -> None:
        """Track `key` as the most recently used (moving it there if already tracked)."""
        if key in self._leases:
            return
        self._order[key] = None
        self._order.move_to_end(key)

    def lease(self, key: Hashable) -> None:
        """Take one lease on a tracked `key`: it is not a victim until every lease is released."""
        if key in self._leases:
            self._leases[key] += 1
            return
        if key not in self._order:
            raise KeyError(f"cannot lease untracked key {key!r}; add it first")
        del self._order[key]
        self._leases[key] = 1

    def release(self, key: Hashable) -> None:
        """Give back one lease on `key`; the last release makes it the most recently used."""
        count = self._leases.get(key)
        if count is None:
            return
        if count > 1:
            self._leases[key] = count - 1
            return
        del self._leases[key]
        self._order[key] = None

    def pop_victim(self) -> Hashable | None:
        """Remove and return the least recent unleased key, or None when all are leased."""
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]
