"""Refines a cost model from observed step times over a sliding, recency-weighted window."""

from __future__ import annotations

from collections import deque
from contextlib import suppress

from halfmoon.router.cost_model import (
    DECODE_TERMS,
    PREFILL_TERMS,
    CostModel,
    fit_decode,
    fit_prefill,
)
from halfmoon.router.errors import ProfileError


class OnlineRefit:
    """Keeps the last `window` observations and refits `model` every `every` of them.

    A window that spans too few distinct shapes to fit keeps the previous coefficients.
    """

    def __init__(
        self, model: CostModel, window: int = 512, every: int = 64, half_life: int = 128
    ) -> None:
        self.model = model
        self.every = every
        self._decay = 0.5 ** (1.0 / half_life)
        self._prefill: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._decode: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_prefill = 0
        self._since_decode = 0

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Record one measured prefill; refit the prefill terms when enough are new."""
        self._prefill.append((float(new_tokens), float(cached_tokens), seconds))
        self._since_prefill += 1
        if self._since_prefill >= self.every and len(self._prefill) >= 2 * len(PREFILL_TERMS):
            self._since_prefill = 0
            with suppress(ProfileError):
                coef = fit_prefill(list(self._prefill), self._weights(len(self._prefill)))
                self.model.prefill_coef = coef

    def observe_decode_step(self, batch_size: int, kv_tokens: int, seconds: float) -> None:
        """Record one measured decode step; refit the decode terms when enough are new."""
        self._decode.append((float(batch_size), float(kv_tokens), seconds))
        self._since_decode += 1
        if self._since_decode >= self.every and len(self._decode) >= 2 * len(DECODE_TERMS):
            self._since_decode = 0
            with suppress(ProfileError):
                coef = fit_decode(list(self._decode), self._weights(len(self._decode)))
                self.model.decode_coef = coef

    def _weights(self, count: int) -> list[float]:
        # Newest sample weighs 1, one half-life older weighs 0.5.
        return [self._decay ** (count - 1 - i) for i in range(count)]
