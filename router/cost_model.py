"""Predicted step times: prefill as a small polynomial in new and cached tokens, decode as a
linear function of batch size and KV tokens, both fitted by least squares.

A prefill step may carry several chunks (of one or more requests); its time is the constant
plus the per-chunk terms summed, so one set of coefficients times a whole unchunked prompt,
a chunked prompt (`chunk_tokens` > 0: the sum over its chunks, as the engine runs it) and a
batched step alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from halfmoon.router.errors import ProfileError

PREFILL_TERMS = ("const_s", "per_token_s", "per_token_sq_s", "per_token_cached_s")
DECODE_TERMS = ("const_s", "per_seq_s", "per_kv_token_s")


def prefill_features(new_tokens: float, cached_tokens: float) -> list[float]:
    """Terms of the prefill polynomial: 1, n, n^2 (causal attention), n * cached."""
    return [1.0, new_tokens, new_tokens * new_tokens, new_tokens * cached_tokens]


def step_features(chunks: Iterable[tuple[float, float]]) -> list[float]:
    """Prefill terms of one step computing `chunks` of (new tokens, tokens before them)."""
    row = [1.0, 0.0, 0.0, 0.0]
    for new, before in chunks:
        row[1] += new
        row[2] += new * new
        row[3] += new * before
    return row


def step_sample(step) -> tuple[str, tuple, float] | None:
    """What a logged engine step (`engine.llm_engine.StepTiming`) teaches the cost model:
    ("prefill", its chunks, seconds) for a pure prefill step, ("decode", (batch, KV tokens),
    seconds) for a pure decode step, None for a mixed one. The seconds count the wait before
    the step while work was pending: a request waits that too."""
    seconds = step.seconds + step.waited_s
    if step.prefill_chunks and not step.decode_seqs:
        return "prefill", step.prefill_chunks, seconds
    if step.decode_seqs and not step.prefill_chunks:
        return "decode", (step.decode_seqs, step.decode_kv_tokens), seconds
    return None


def chunk_spans(new_tokens: int, cached_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """The (new tokens, tokens before) chunks the engine computes a prompt in: each chunk ends
    on a multiple of `chunk_tokens` (0: the whole remainder in one chunk)."""
    if chunk_tokens <= 0:
        return [(new_tokens, cached_tokens)] if new_tokens > 0 else []
    spans, done, end = [], cached_tokens, cached_tokens + new_tokens
    while done < end:
        size = min(end - done, chunk_tokens - done % chunk_tokens)
        spans.append((size, done))
        done += size
    return spans


def decode_features(batch_size: float, kv_tokens: float) -> list[float]:
    """Terms of the decode step model: 1 (weights read), batch size, KV tokens read."""
    return [1.0, batch_size, kv_tokens]


def _least_squares(rows: list[list[float]], seconds: list[float], weights: Sequence[float] | None):
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if weights is not None:
        w = np.sqrt(np.asarray(weights, dtype=np.float64))
        x, y = x * w[:, None], y * w
    # Scale columns so n^2 terms do not swamp the constant in the solve.
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _, rank, _ = np.linalg.lstsq(x / scale, y, rcond=None)
    if rank < x.shape[1]:
        raise ProfileError(
            f"samples span only {rank} of {x.shape[1]} terms; profile more distinct shapes"
        )
    return [float(c) for c in coef / scale]


@dataclass(slots=True)
class CostModel:
    """Prefill and decode step times of one worker kind, in seconds."""

    prefill_coef: tuple[float, float, float, float]
    decode_coef: tuple[float, float, float]
    # The engine prefills in chunks ending on multiples of this (0: whole prompts at once).
    chunk_tokens: int = 0

    def prefill_time(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to prefill `new_tokens` on top of `cached_tokens` already held."""
        if (
            self.chunk_tokens <= 0
            or new_tokens <= self.chunk_tokens - cached_tokens % self.chunk_tokens
        ):
            a, b, c, d = self.prefill_coef
            # A fit over a narrow window can extrapolate below zero; time never runs backwards.
            return max(0.0, a + new_tokens * (b + c * new_tokens + d * cached_tokens))
        spans = chunk_spans(int(new_tokens), int(cached_tokens), self.chunk_tokens)
        return sum(self.prefill_step_time((span,)) for span in spans)

    def prefill_step_time(self, chunks: Iterable[tuple[float, float]]) -> float:
        """Seconds for one engine step computing prefill `chunks` of (new, tokens before)."""
        a, b, c, d = self.prefill_coef
        total = a
        for new, before in chunks:
            total += new * (b + c * new + d * before)
        return max(0.0, total)

    def step_time(
        self, chunks: Sequence[tuple[float, float]], batch_size: float, kv_tokens: float
    ) -> float:
        """Seconds for one engine step of prefill `chunks` beside `batch_size` decoding
        sequences reading `kv_tokens`: a mixed step pays one step constant, decode's."""
        if not batch_size:
            return self.prefill_step_time(chunks)
        decode_s = self.decode_step_time(batch_size, kv_tokens)
        if not chunks:
            return decode_s
        return decode_s + max(0.0, self.prefill_step_time(chunks) - self.prefill_coef[0])

    def decode_step_time(self, batch_size: float, kv_tokens: float) -> float:
        """Seconds for one decode step of `batch_size` sequences reading `kv_tokens` of KV."""
        a, b, c = self.decode_coef
        return max(0.0, a + b * batch_size + c * kv_tokens)

    @classmethod
    def fit(
        cls,
        prefill_samples: Iterable[tuple[float, float, float]],
        decode_samples: Iterable[tuple[float, float, float]],
    ) -> CostModel:
        """Least-squares fit from (new, cached, seconds) and (batch, kv_tokens, seconds) samples."""
        return cls(fit_prefill(list(prefill_samples)), fit_decode(list(decode_samples)))

    @classmethod
    def fit_steps(
        cls, steps: Iterable, chunk_tokens: int = 0, fallback: CostModel | None = None
    ) -> CostModel:
        """Least-squares fit from engine steps (`engine.llm_engine.StepTiming`): pure prefill
        steps fit the prefill terms, pure decode steps the decode terms (`step_sample`).

        When the steps do not span a part's terms (a short run, one batch size), that part
        keeps `fallback`'s coefficients; without a fallback it is a ProfileError."""
        rows, seconds, decode = [], [], []
        for kind, shape, step_s in filter(None, map(step_sample, steps)):
            if kind == "prefill":
                rows.append(step_features(shape))
                seconds.append(step_s)
            else:
                decode.append((*shape, step_s))
        try:
            prefill = fit_prefill_rows(rows, seconds)
        except ProfileError:
            if fallback is None:
                raise
            prefill = fallback.prefill_coef
        try:
            decode_coef = fit_decode(decode)
        except ProfileError:
            if fallback is None:
                raise
            decode_coef = fallback.decode_coef
        return cls(prefill, decode_coef, chunk_tokens)

    def to_dict(self) -> dict[str, dict[str, float]]:
        """The coefficients keyed by term name, as written in a profile."""
        prefill = dict(zip(PREFILL_TERMS, self.prefill_coef, strict=True))
        if self.chunk_tokens:
            prefill["chunk_tokens"] = self.chunk_tokens
        return {
            "prefill": prefill,
            "decode": dict(zip(DECODE_TERMS, self.decode_coef, strict=True)),
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Build from a profile's `prefill` and `decode` sections."""
        prefill = _terms(data, "prefill", PREFILL_TERMS)
        decode = _terms(data, "decode", DECODE_TERMS)
        chunk = data["prefill"].get("chunk_tokens", 0)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ProfileError(
                f"profile `prefill.chunk_tokens` = {chunk!r} must be an integer >= 0"
            )
        return cls(
            (prefill[0], prefill[1], prefill[2], prefill[3]),
            (decode[0], decode[1], decode[2]),
            chunk,
        )


def fit_prefill(
    samples: Sequence[tuple[float, float, float]], weights: Sequence[float] | None = None
) -> tuple[float, float, float, float]:
    """Prefill coefficients from (new_tokens, cached_tokens, seconds) samples."""
    _need(samples, len(PREFILL_TERMS), "prefill")
    rows = [prefill_features(n, c) for n, c, _ in samples]
    return fit_prefill_rows(rows, [s for *_, s in samples], weights)


def fit_prefill_rows(
    rows: Sequence[Sequence[float]],
    seconds: Sequence[float],
    weights: Sequence[float] | None = None,
) -> tuple[float, float, float, float]:
    """Prefill coefficients from step feature rows (`step_features`) and their seconds."""
    _need(rows, len(PREFILL_TERMS), "prefill")
    a, b, c, d = _least_squares([list(r) for r in rows], list(seconds), weights)
    return (a, b, c, d)


def fit_decode(
    samples: Sequence[tuple[float, float, float]], weights: Sequence[float] | None = None
) -> tuple[float, float, float]:
    """Decode coefficients from (batch_size, kv_tokens, seconds) samples."""
    _need(samples, len(DECODE_TERMS), "decode")
    rows = [decode_features(b, k) for b, k, _ in samples]
    a, b, c = _least_squares(rows, [s for *_, s in samples], weights)
    return (a, b, c)


def _need(samples: Sequence, terms: int, what: str) -> None:
    if len(samples) < terms:
        raise ProfileError(
            f"{len(samples)} {what} samples cannot fit {terms} terms; profile at least {terms} "
            "distinct shapes"
        )


def _terms(data: dict, section: str, names: tuple[str, ...]) -> list[float]:
    block = data.get(section)
    if not isinstance(block, dict):
        raise ProfileError(f"profile has no `{section}` section; add one with terms {names}")
    missing = [name for name in names if name not in block]
    if missing:
        raise ProfileError(f"profile `{section}` lacks {missing}; every term of {names} is needed")
    values = [float(block[name]) for name in names]
    if not all(np.isfinite(values)):
        raise ProfileError(f"profile `{section}` holds a non-finite coefficient: {values}")
    return values
