"""Read-only questions about the Conductor's state (`Conductor.view()`), for the pool's load
figures, the server's info, the simulator's summary and tests."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from halfmoon.router.decision import Decision
from halfmoon.router.estimates import Estimates
from halfmoon.router.fleet import Fleet
from halfmoon.router.placed import PlacedRequests
from halfmoon.router.prediction_error import PredictionErrorStats
from halfmoon.router.predictor import Location
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile
from halfmoon.router.replication import Replicator


@dataclass(frozen=True, slots=True)
class ConductorView:
    """What the Conductor knows, asked without changing it."""

    _estimates: Estimates
    _fleet: Fleet
    _placed: PlacedRequests
    _index: PrefixIndex
    _replicator: Replicator | None

    @property
    def profile(self) -> Profile:
        """The profile as it stands: measured at start, calibrated, refit online."""
        return self._estimates.profile

    def prefill_time_s(self, num_tokens: int) -> float:
        """The cost model's prefill time of `num_tokens` uncached tokens."""
        return self._estimates.profile.cost.prefill_time(num_tokens, 0)

    def prediction_error(self) -> PredictionErrorStats:
        """How far predicted TTFT was from the observed TTFT."""
        return self._estimates.errors.stats()

    def decision(self, request_id: str) -> Decision | None:
        """The remembered decision for `request_id`, if still kept."""
        return self._placed.decision(request_id)

    @property
    def num_indexed_blocks(self) -> int:
        """Blocks the prefix index holds, over every instance and tier."""
        return len(self._index)

    def longest_prefix(self, keys: Sequence[Hashable]) -> dict[Location, int]:
        """Leading blocks of `keys` the index holds, per (instance, tier)."""
        return self._index.longest_prefix(keys)

    def reserved_kv_tokens(self, instance: Hashable) -> int | None:
        """KV tokens held back for requests placed on decode `instance` (None if unknown)."""
        view = self._fleet.decode.get(instance)
        return None if view is None else view.reserved_tokens

    def pool_load(self, now: float) -> tuple[float, float]:
        """(summed predicted prefill queue seconds, worst predicted decode TBT now)."""
        return self._fleet.pool_load(now, self._estimates.predictor)

    @property
    def num_replications_planned(self) -> int:
        """Hot-prefix copies `route` planned (0 without `RouterConfig.replicate`)."""
        return 0 if self._replicator is None else self._replicator.num_planned

    @property
    def num_replications_completed(self) -> int:
        """Planned copies that landed or failed."""
        return 0 if self._replicator is None else self._replicator.num_completed
