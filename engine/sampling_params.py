"""Sampling and stopping parameters of one request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from halfmoon.engine.errors import InvalidRequestError

# torch.Generator.manual_seed takes a signed 64-bit value: 2**63 and above overflow.
SEED_LIMIT = 2**63


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; `temperature=0` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first field out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", self.temperature, "must be finite and >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(
                "top_k", self.top_k, "must be -1 or 0 (off) or an integer >= 1"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", self.top_p, "must be in (0, 1]")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not _is_int_in(self.seed, 0, SEED_LIMIT):
            raise InvalidRequestError("seed", self.seed, "must be an integer in [0, 2**63)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise InvalidRequestError("logprobs", self.logprobs, "must be None or an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", self.stop, "must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids", self.stop_token_ids, "must be non-negative token ids"
            )


def _is_int_in(value: object, low: int, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < limit


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
