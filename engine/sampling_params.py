"""Sampling and stopping parameters of one request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput

# torch.Generator.manual_seed takes a signed 64-bit value: 2**63 and above overflow.
SEED_LIMIT = 2**63
# OpenAI's ranges for the penalties and the biases.
PENALTY_LIMIT = 2.0
BIAS_LIMIT = 100.0
# Entries of one request's logit_bias (OpenAI's cap): the work it adds to every step is bounded.
MAX_LOGIT_BIAS = 300


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Sequences sampled from the one prompt (OpenAI's choices); sequence i draws with seed + i.
    n: int = 1
    # The grammar the output must match (JSON schema, regex, choice...; engine/grammar.py).
    structured_output: StructuredOutput | None = None
    # logit_bias as arrays (token ids, biases), made once by `bias_arrays`.
    _bias: tuple[np.ndarray, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.validate()

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as (token ids int64, biases float32), made on first use."""
        if self._bias is None:
            ids = np.fromiter(self.logit_bias.keys(), np.int64, len(self.logit_bias))
            values = np.fromiter(self.logit_bias.values(), np.float32, len(self.logit_bias))
            self._bias = ids, values
        return self._bias

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any bias or penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.repeats_penalized

    @property
    def repeats_penalized(self) -> bool:
        """Whether a penalty depends on the tokens seen so far."""
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first field out of range; token ids are
        checked against `vocab_size` when given (the engine knows it, a frontend may not)."""
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
        if not _is_int_in(self.n, 1, math.inf):
            raise InvalidRequestError("n", self.n, "must be an integer >= 1")
        if self.seed is not None and not _is_int_in(self.seed, 0, SEED_LIMIT):
            raise InvalidRequestError("seed", self.seed, "must be an integer in [0, 2**63)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise InvalidRequestError("logprobs", self.logprobs, "must be None or an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", self.stop, "must be a list of non-empty strings")
        limit = math.inf if vocab_size is None else vocab_size
        if any(not _is_int_in(t, 0, limit) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", self.stop_token_ids, _ids_in(vocab_size))
        self._validate_penalties()
        _validate_logit_bias(self.logit_bias, vocab_size)
        if self.structured_output is not None:
            self.structured_output.validate()

    def _validate_penalties(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InvalidRequestError(name, value, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", self.repetition_penalty, "must be finite and > 0 (1 is off)"
            )


def _validate_logit_bias(bias: object, vocab_size: int | None) -> None:
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", bias, "must be a dict of token id to bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            "logit_bias", f"<{len(bias)} entries>", f"at most {MAX_LOGIT_BIAS} entries"
        )
    limit = math.inf if vocab_size is None else vocab_size
    for token_id, value in bias.items():
        if not _is_int_in(token_id, 0, limit):
            raise InvalidRequestError("logit_bias", {token_id: value}, _ids_in(vocab_size))
        if not _is_real(value) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise InvalidRequestError(
                "logit_bias", {token_id: value}, "biases must be in [-100, 100]"
            )


def _ids_in(vocab_size: int | None) -> str:
    return (
        "token ids must be >= 0"
        if vocab_size is None
        else f"token ids must be in [0, {vocab_size})"
    )


def _is_int_in(value: object, low: int, limit: float) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < limit


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
