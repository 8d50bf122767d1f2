"""What the router needs to know about one request to place it."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class RouteRequest:
    """A request to place: its block keys, lengths, arrival time and optional SLO override."""

    request_id: str
    block_keys: Sequence[Hashable]
    num_prompt_tokens: int
    max_output_tokens: int
    arrival_s: float
    expected_output_tokens: int | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
