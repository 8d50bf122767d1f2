"""Refines a cost model from observed step times over a sliding, recency-weighted window."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import suppress

from halfmoon.router.cost_model import (
    DECODE_TERMS,
    PREFILL_TERMS,
    CostModel,
    fit_decode,
    fit_prefill_rows,
    prefill_features,
    step_features,
)
from halfmoon.router.errors import ProfileError


class OnlineRefit:
    """Keeps the last `window` observations and refits `model` every `every` of them (sooner
    while the window fills: once it holds twice as many as were new, so the first refit comes
    after a few steps, when the start-up profile is furthest from the serving machine).

    A window that spans too few distinct shapes to fit keeps the previous coefficients.
    """

    def __init__(
        self, model: CostModel, window: int = 512, every: int = 64, half_life: int = 128
    ) -> None:
        self.model = model
        self.every = every
        self._decay = 0.5 ** (1.0 / half_life)
        self._prefill: deque[tuple[list[float], float]] = deque(maxlen=window)
        self._decode: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_prefill = 0
        self._since_decode = 0

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one measured prefill run as one step; refit when enough are new."""
        self._add_prefill(prefill_features(new_tokens, cached_tokens), seconds)

    def observe_prefill_step(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """Record one measured step of prefill `chunks` of (new tokens, tokens before)."""
        self._add_prefill(step_features(chunks), seconds)

    def _add_prefill(self, row: list[float], seconds: float) -> None:
        self._prefill.append((row, seconds))
        self._since_prefill += 1
        if self._due(self._since_prefill, len(self._prefill), len(PREFILL_TERMS)):
            self._since_prefill = 0
            with suppress(ProfileError):
                rows = [row for row, _ in self._prefill]
                seconds = [s for _, s in self._prefill]
                weights = self._weights(len(rows))
                self.model.prefill_coef = fit_prefill_rows(rows, seconds, weights)

    def observe_decode_step(self, batch_size: int, kv_tokens: int, seconds: float) -> None:
        """Record one measured decode step; refit the decode terms when enough are new."""
        self._decode.append((float(batch_size), float(kv_tokens), seconds))
        self._since_decode += 1
        if self._due(self._since_decode, len(self._decode), len(DECODE_TERMS)):
            self._since_decode = 0
            with suppress(ProfileError):
                coef = fit_decode(list(self._decode), self._weights(len(self._decode)))
                self.model.decode_coef = coef

    def _due(self, num_new: int, num_kept: int, num_terms: int) -> bool:
        """Whether to refit: `every` new observations, or half of those kept while the window
        fills (never from fewer than twice the terms, nor more often than every 8)."""
        if num_kept < 2 * num_terms:
            return False
        return num_new >= min(self.every, max(8, num_kept // 2))

    def _weights(self, count: int) -> list[float]:
        # Newest sample weighs 1, one half-life older weighs 0.5.
        return [self._decay ** (count - 1 - i) for i in range(count)]


class RecentMean:
    """The mean of the last `capacity` values added, kept in constant time per value."""

    def __init__(self, capacity: int) -> None:
        self._values: deque[float] = deque(maxlen=capacity)
        self._sum = 0.0

    def add(self, value: float) -> float:
        """Add `value`; returns the mean of the window with it."""
        if len(self._values) == self._values.maxlen:
            self._sum -= self._values[0]
        self._values.append(value)
        self._sum += value
        return self._sum / len(self._values)

    def clear(self) -> None:
        self._values.clear()
        self._sum = 0.0
