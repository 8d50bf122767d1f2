"""How the paged decode kernel cuts a context into splits (split-K), in plain Python: the
engine sizes its decode graphs by it without importing Triton."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_N = 64
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# Up to this context every split holds MIN_SPLIT_TOKENS; past it the splits grow longer.
FULL_SPLIT_TOKENS = MAX_SPLITS * MIN_SPLIT_TOKENS


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """A context of up to `max_len` tokens cut into `num_splits` chunks of `tokens_per_split`."""

    num_splits: int
    tokens_per_split: int


def plan_splits(max_len: int) -> SplitPlan:
    """At least `MIN_SPLIT_TOKENS` per split so the reduction stays cheap; at most `MAX_SPLITS`."""
    max_len = max(max_len, 1)
    wanted = min(MAX_SPLITS, _cdiv(max_len, MIN_SPLIT_TOKENS))
    tokens_per_split = _cdiv(_cdiv(max_len, wanted), BLOCK_N) * BLOCK_N
    return SplitPlan(_cdiv(max_len, tokens_per_split), tokens_per_split)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
