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


class PredictionErrorLog:
    """The last `capacity` (predicted, actual) TTFT pairs."""

    def __init__(self, capacity: int = 10_000) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=capacity)

    def record(self, predicted_s: float, actual_s: float) -> None:
        """Add one pair."""
        self._pairs.append((predicted_s, actual_s))

    def stats(self) -> PredictionErrorStats:
        """Mean and p90 absolute error, and mean error relative to the actual TTFT."""
        if not self._pairs:
            return PredictionErrorStats(0, 0.0, 0.0, 0.0)
        errors = sorted(abs(p - a) for p, a in self._pairs)
        rel = sum(abs(p - a) / a for p, a in self._pairs if a > 0) / len(self._pairs)
        p90 = errors[min(int(0.9 * len(errors)), len(errors) - 1)]
        return PredictionErrorStats(len(errors), sum(errors) / len(errors), p90, rel)
