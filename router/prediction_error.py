"""Predicted against actual TTFT, kept so prediction error is a metric."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PredictionErrorStats:
    """Error of TTFT predictions over the last observations, in seconds and relative."""

    count: int
    mean_abs_s: float
    p90_abs_s: float
    mean_rel: float


# The TTFT bound's calibration: how much the recent predictions of at least a quarter of the
# bound fell short, at this quantile of the last CALIBRATION_WINDOW such requests.
CALIBRATION_QUANTILE = 0.9
CALIBRATION_WINDOW = 200
CALIBRATION_MIN_COUNT = 10


class PredictionErrorLog:
    """The last `capacity` (predicted, actual) TTFT pairs."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=capacity)
        self._shortfalls: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_WINDOW)
        self._shortfall: float | None = 1.0

    def record(self, predicted_s: float, actual_s: float) -> None:
        """Add one pair."""
        self._pairs.append((predicted_s, actual_s))
        if predicted_s > 0:
            self._shortfalls.append((predicted_s, actual_s / predicted_s))
            self._shortfall = None

    def shortfall(self, min_predicted_s: float) -> float:
        """How many times longer than predicted the recent requests predicted to wait at least
        `min_predicted_s` waited (the 90th percentile, >= 1; 1 until there are 10 of them)."""
        if self._shortfall is None:
            ratios = sorted(r for p, r in self._shortfalls if p >= min_predicted_s)
            if len(ratios) < CALIBRATION_MIN_COUNT:
                self._shortfall = 1.0
            else:
                index = min(int(CALIBRATION_QUANTILE * len(ratios)), len(ratios) - 1)
                self._shortfall = max(ratios[index], 1.0)
        return self._shortfall

    def stats(self) -> PredictionErrorStats:
        """Mean and p90 absolute error, and mean error relative to the actual TTFT."""
        if not self._pairs:
            return PredictionErrorStats(0, 0.0, 0.0, 0.0)
        errors = sorted(abs(p - a) for p, a in self._pairs)
        rel = sum(abs(p - a) / a for p, a in self._pairs if a > 0) / len(self._pairs)
        p90 = errors[min(int(0.9 * len(errors)), len(errors) - 1)]
        return PredictionErrorStats(len(errors), sum(errors) / len(errors), p90, rel)
