"""Leases with deadlines: a leased block is never evicted until released or expired."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

from halfmoon.kvstore.eviction import LruEviction


class LeaseTable:
    """Grants ref-counted leases on tracked keys and expires them at their deadline."""

    __slots__ = ("_lru", "_clock", "_leases", "_deadlines", "_ids")

    def __init__(self, lru: LruEviction, clock: Callable[[], float]) -> None:
        self._lru = lru
        self._clock = clock
        self._leases: dict[int, list[Hashable]] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, keys: Sequence[Hashable], ttl_s: float) -> int:
        """Lease every tracked key of `keys` for `ttl_s` seconds; return the lease id."""
        lease_id = next(self._ids)
        held = [key for key in keys if key in self._lru]
        for key in held:
            self._lru.lease(key)
        self._leases[lease_id] = held
        heapq.heappush(self._deadlines, (self._clock() + ttl_s, lease_id))
        return lease_id

    def extend(self, lease_id: int, keys: Sequence[Hashable]) -> None:
        """Add tracked `keys` to a live lease (keys that arrived while its holder waited)."""
        held = self._leases.get(lease_id)
        if held is None:
            return
        already = set(held)
        for key in keys:
            if key in self._lru and key not in already:
                already.add(key)
                self._lru.lease(key)
                held.append(key)

    def release(self, lease_id: int) -> bool:
        """Release a lease; False when it already expired or was released."""
        held = self._leases.pop(lease_id, None)
        if held is None:
            return False
        for key in held:
            self._lru.release(key)
        return True

    def expire(self) -> int:
        """Release every lease past its deadline; return how many expired."""
        now = self._clock()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            expired += self.release(lease_id)
        return expired
