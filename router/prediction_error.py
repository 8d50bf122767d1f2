"""Predicted against actual TTFT, kept so prediction error is a metric."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class PredictionErrorStats:
    """Error of TTFT predictions over the last observations, in seconds and relative."""

    count: int
    mean_abs_s: float
    p90_abs_s: float
    mean_rel: float


# The TTFT bound's calibration: how much the recent predictions of at least CALIBRATION_SHARE
# of the bound fell short, at this quantile of the last CALIBRATION_WINDOW such requests; with fewer
# than CALIBRATION_MIN_COUNT, the most any of them fell short.
CALIBRATION_SHARE = 0.25
CALIBRATION_QUANTILE = 0.9
CALIBRATION_WINDOW = 200
CALIBRATION_MIN_COUNT = 10


class PredictionErrorLog:
    """The last `capacity` (predicted, actual) TTFT pairs."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._shortfalls: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_WINDOW)
        self._served: tuple[float, list[float]] | None = None  # (min predicted, sorted ratios)

    def record(self, predicted_s: float, actual_s: float) -> None:
        """Add one pair."""
        self._pairs.append((predicted_s, actual_s))
        if predicted_s > 0:
            self._shortfalls.append((predicted_s, actual_s / predicted_s))
            self._served = None

    def shortfall(
        self, bound_s: float | None, waiting: Iterable[tuple[float, float]] = ()
    ) -> float:
        """How many times longer than predicted the recent requests predicted to wait at least
        a quarter of the TTFT bound `bound_s` waited (the 90th percentile; the largest while
        there are fewer than 10; >= 1; 1 without a bound). `waiting`: (predicted, waited so
        far) of requests not served yet, counted as they stand, so a burst is scaled before
        its first request is served."""
        if bound_s is None:
            return 1.0
        min_predicted_s = bound_s * CALIBRATION_SHARE
        late = [w / p for p, w in waiting if p >= min_predicted_s]
        ratios = self._served_ratios(min_predicted_s)
        ratios = sorted(ratios + late) if late else ratios
        if len(ratios) < CALIBRATION_MIN_COUNT:
            return max(ratios[-1] if ratios else 1.0, 1.0)
        return max(ratios[min(int(CALIBRATION_QUANTILE * len(ratios)), len(ratios) - 1)], 1.0)

    def _served_ratios(self, min_predicted_s: float) -> list[float]:
        """The recorded shortfalls of predictions of `min_predicted_s` or more, sorted; kept
        until the next record, since every decision under a bound asks for them."""
        if self._served is None or self._served[0] != min_predicted_s:
            ratios = sorted(r for p, r in self._shortfalls if p >= min_predicted_s)
            self._served = (min_predicted_s, ratios)
        return self._served[1]

    def stats(self) -> PredictionErrorStats:
        """Mean and p90 absolute error, and mean error relative to the actual TTFT."""
        if not self._pairs:
            return PredictionErrorStats(0, 0.0, 0.0, 0.0)
        errors = sorted(abs(p - a) for p, a in self._pairs)
        rel = sum(abs(p - a) / a for p, a in self._pairs if a > 0) / len(self._pairs)
        p90 = errors[min(int(0.9 * len(errors)), len(errors) - 1)]
        return PredictionErrorStats(len(errors), sum(errors) / len(errors), p90, rel)
