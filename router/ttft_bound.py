"""router.max_ttft_s at one arrival: a request is rejected when its own predicted TTFT, or
that of a request it would slow down, breaks the bound."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from halfmoon.router.placement import Placement
from halfmoon.router.prediction_error import PredictionErrorLog
from halfmoon.router.views import PrefillView


@dataclass(slots=True)
class TtftBound:
    """The bound (None: none), how many times longer than predicted recent requests waited
    (`shortfall`, >= 1, which predictions are scaled by), and the prefill views at `now`."""

    max_ttft_s: float | None
    shortfall: float = 1.0
    views: Mapping[Hashable, PrefillView] = field(default_factory=dict)
    now: float = 0.0

    @classmethod
    def of(
        cls,
        max_ttft_s: float | None,
        errors: PredictionErrorLog,
        views: Mapping[Hashable, PrefillView],
        now: float,
    ) -> TtftBound:
        """The bound at `now`, scaled by the recent predictions' shortfall, prefills running
        past their predicted end included."""
        late = (pair for view in views.values() for pair in view.overdue(now))
        return cls(max_ttft_s, errors.shortfall(max_ttft_s, late), views, now)

    def reason(self, placement: Placement, predicted_ttft_s: float) -> str:
        """Why a request placed as `placement`, predicted to wait `predicted_ttft_s` for its
        first token, must be rejected, or "" to admit it."""
        view = None if placement.bypass else self.views.get(placement.prefill_instance)
        # Alone on an idle worker it waits for nothing: admitted, or a cost model far slower
        # than the machine would turn every request away and, with none served, never learn.
        if self.max_ttft_s is None or (view is not None and not view.jobs):
            return ""
        own_s = predicted_ttft_s * self.shortfall
        if own_s > self.max_ttft_s:
            what = f"predicted TTFT {own_s:.3f}s"
        else:
            pushed_s = self._pushed_s(view, placement, predicted_ttft_s - placement.ttft_s)
            if pushed_s <= self.max_ttft_s:
                return ""
            what = f"it would slow a request already there to a TTFT of {pushed_s:.3f}s"
        scale = f" ({self.shortfall:.2f}x, as recent requests waited)" if self.shortfall > 1 else ""
        return (
            f"{what}{scale} on {placement.prefill_instance} exceeds router.max_ttft_s "
            f"{self.max_ttft_s:.3f}s; retry later or add prefill workers"
        )

    def _pushed_s(self, view: PrefillView | None, placement: Placement, overhead_s: float) -> float:
        """The latest predicted TTFT of the requests prefilling on `view`, were it to take
        this one: an engine that prefills in chunks shares its steps among its prompts, so
        each new one slows those already there."""
        if view is None or not view.shared:
            return 0.0
        ends = view.ends_with(self.now, placement.plan.work_s)
        return max((w + (left_s + overhead_s) * self.shortfall for w, left_s in ends), default=0.0)
