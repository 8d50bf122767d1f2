"""The cluster-wide prefix index: which instance and tier hold which blocks (DESIGN.md, "Index")."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from halfmoon.kvstore.block_events import BlockEvent

Location = tuple[str, str]


class PrefixIndex:
    """Maps block keys to the (instance, tier) locations holding them, fed by block events."""

    __slots__ = ("_locations", "_num_blocks")

    def __init__(self) -> None:
        self._locations: dict[Hashable, set[Location]] = {}
        self._num_blocks: dict[Location, int] = {}

    def __len__(self) -> int:
        """Number of distinct keys held anywhere."""
        return len(self._locations)

    def num_blocks(self, instance: str, tier: str) -> int:
        """Number of blocks the index believes `tier` of `instance` holds."""
        return self._num_blocks.get((instance, tier), 0)

    def apply(self, event: BlockEvent) -> None:
        """Apply one stored or evicted event."""
        if event.kind == "stored":
            self.stored(event.instance, event.tier, event.keys)
        else:
            self.evicted(event.instance, event.tier, event.keys)

    def stored(self, instance: str, tier: str, keys: Iterable[Hashable]) -> None:
        """Record that `tier` of `instance` now holds `keys`."""
        location = (instance, tier)
        added = 0
        for key in keys:
            holders = self._locations.setdefault(key, set())
            if location not in holders:
                holders.add(location)
                added += 1
        self._num_blocks[location] = self._num_blocks.get(location, 0) + added

    def evicted(self, instance: str, tier: str, keys: Iterable[Hashable]) -> None:
        """Record that `tier` of `instance` no longer holds `keys`."""
        location = (instance, tier)
        removed = 0
        for key in keys:
            holders = self._locations.get(key)
            if holders is None or location not in holders:
                continue
            holders.remove(location)
            removed += 1
            if not holders:
                del self._locations[key]
        remaining = self._num_blocks.get(location, 0) - removed
        if remaining > 0:
            self._num_blocks[location] = remaining
        else:
            self._num_blocks.pop(location, None)

    def drop_instance(self, instance: str) -> None:
        """Forget every block of `instance` (it died or left the cluster)."""
        for key in list(self._locations):
            holders = self._locations[key]
            holders.difference_update({loc for loc in holders if loc[0] == instance})
            if not holders:
                del self._locations[key]
        for location in [loc for loc in self._num_blocks if loc[0] == instance]:
            del self._num_blocks[location]

    def longest_prefix(self, keys: Sequence[Hashable]) -> dict[Location, int]:
        """Per location holding the first block: how many leading blocks of `keys` it holds."""
        result: dict[Location, int] = {}
        if not keys:
            return result
        alive = set(self._locations.get(keys[0], ()))
        depth = 0
        for key in keys:
            holders = self._locations.get(key)
            if holders is None:
                break
            lost = alive - holders
            for location in lost:
                result[location] = depth
            alive -= lost
            if not alive:
                break
            depth += 1
        for location in alive:
            result[location] = depth
        return result
