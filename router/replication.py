"""Hot-prefix replication: count recent prefix accesses and, when a hot prefix sits only on
busy instances, plan a copy toward an instance that can serve it sooner (Mooncake's
Conductor replicates hot KVCache blocks so load can spread without repeated fetches)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from halfmoon.router.config import RouterConfig
from halfmoon.router.predictor import Location, PrefixHits
from halfmoon.router.views import PrefillView


@dataclass(slots=True, frozen=True)
class Replication:
    """Copy the prefix chain `keys` from `source` into prefill instance `target`'s cache;
    `num_tokens` is what actually moves (the blocks the target lacked when planned)."""

    keys: tuple[Hashable, ...]
    source: Location
    target: Hashable
    num_tokens: int


class HotPrefixTracker:
    """Accesses per block key over the last `window_requests` to 2 x `window_requests`
    requests: two generations of counts, the older dropped whole, so nothing decays per key."""

    __slots__ = ("window_requests", "_current", "_previous", "_seen")

    def __init__(self, window_requests: int) -> None:
        self.window_requests = window_requests
        self._current: dict[Hashable, int] = {}
        self._previous: dict[Hashable, int] = {}
        self._seen = 0

    def hits(self, key: Hashable) -> int:
        """Recent accesses of the prefix ending at block `key`."""
        return self._current.get(key, 0) + self._previous.get(key, 0)

    def record(self, keys: Sequence[Hashable], depth: int, min_hits: int) -> int:
        """Count one access of `keys[:depth]`; return how many leading blocks now have at
        least `min_hits` recent accesses (the hot part of the prefix)."""
        self._seen += 1
        if self._seen > self.window_requests:
            self._previous, self._current, self._seen = self._current, {}, 1
        current, previous = self._current, self._previous
        hot = 0
        for i in range(depth):
            key = keys[i]
            count = current.get(key, 0) + 1
            current[key] = count
            if hot == i and count + previous.get(key, 0) >= min_hits:
                hot = i + 1
        return hot


class Replicator:
    """Decides, after each placement, whether the request's hot prefix should be copied."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tracker = HotPrefixTracker(config.replicate_window_requests)
        self.num_planned = 0
        self.num_completed = 0
        # Last key of a prefix being copied -> when its cooldown ends (cleared on completion).
        self._in_flight: dict[Hashable, float] = {}

    def plan(
        self,
        keys: Sequence[Hashable],
        locations: Mapping[Location, int],
        hits: PrefixHits,
        prefill: Mapping[Hashable, PrefillView],
        served_by: Hashable | None,
        fetched: bool,
        now: float,
    ) -> Replication | None:
        """Count this access of the request's cached prefix; return a copy to make, if any.

        `locations` and `hits` are the index's answer for `keys`, `served_by` the prefill
        instance the request went to and `fetched` whether it fetches its prefix there."""
        if hits.deepest == 0:
            return None
        hot = self.tracker.record(keys, hits.deepest, self.config.replicate_min_hits)
        if hot == 0:
            return None
        last = keys[hot - 1]
        if self._in_flight.get(last, -1.0) > now:
            return None
        local = hits.local_blocks
        holders = [v for name, v in prefill.items() if local.get(name, 0) >= hot]
        if len(holders) >= self.config.replicate_max_copies:
            return None
        target = self._target(prefill, holders, hot, local, served_by, fetched, now)
        if target is None:
            return None
        self._start(last, now)
        source = self._source(locations, prefill, hot, now)
        moved = (hot - local.get(target, 0)) * self.config.block_size
        return Replication(tuple(keys[:hot]), source, target, moved)

    def on_replicated(self, replication: Replication) -> None:
        """A planned copy landed (or failed): its prefix may be copied again when hot."""
        self._in_flight.pop(replication.keys[-1], None)
        self.num_completed += 1

    def _target(
        self,
        prefill: Mapping[Hashable, PrefillView],
        holders: list[PrefillView],
        hot: int,
        local: Mapping[Hashable, int],
        served_by: Hashable | None,
        fetched: bool,
        now: float,
    ) -> Hashable | None:
        # A fetching instance is where the prefix is wanted now; copy it there ahead of need.
        if fetched and served_by in prefill and local.get(served_by, 0) < hot:
            return served_by
        best, best_wait = None, float("inf")
        for name, view in prefill.items():
            if local.get(name, 0) < hot:
                wait = view.wait_s(now)
                if wait < best_wait:
                    best, best_wait = name, wait
        holder_wait = min((v.wait_s(now) for v in holders), default=float("inf"))
        if best is None or best_wait + self.config.replicate_margin_s >= holder_wait:
            return None
        return best

    @staticmethod
    def _source(
        locations: Mapping[Location, int],
        prefill: Mapping[Hashable, PrefillView],
        hot: int,
        now: float,
    ) -> Location:
        # The least busy holder (a store computes nothing, so counts as idle); ties by name,
        # so a run does not depend on the index's set order.
        def busy(location: Location) -> tuple[float, str]:
            view = prefill.get(location[0])
            return (view.wait_s(now) if view is not None else 0.0, str(location))

        return min((loc for loc, depth in locations.items() if depth >= hot), key=busy)

    def _start(self, last: Hashable, now: float) -> None:
        self.num_planned += 1
        in_flight = self._in_flight
        if len(in_flight) > 4 * self.tracker.window_requests:
            for key in [k for k, until in in_flight.items() if until <= now]:
                del in_flight[key]
        in_flight[last] = now + self.config.replicate_cooldown_s
