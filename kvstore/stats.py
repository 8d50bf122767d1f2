"""Counters the store reports for metrics: per tier, and put/get latency."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    """Contents and traffic of one tier; `blocks`/`bytes_` are what the tier holds now."""

    blocks: int = 0
    bytes_: int = 0
    capacity_bytes: int = 0
    leased_blocks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    forged: int = 0  # Redis records whose HMAC did not match (also in `corrupt`)
    pool_timeouts: int = 0  # Redis calls that found no free pooled connection in time
    errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(slots=True)
class LatencyStats:
    """Count, total and worst case of one operation's latency."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def record(self, elapsed_s: float) -> None:
        self.count += 1
        self.total_s += elapsed_s
        self.max_s = max(self.max_s, elapsed_s)


@dataclass(slots=True)
class StoreStats:
    """Everything one store node reports: tiers, movement between them, and latency."""

    host: TierStats = field(default_factory=TierStats)
    redis: TierStats = field(default_factory=TierStats)
    demotions: int = 0
    demotions_dropped: int = 0
    promotions: int = 0
    redis_available: bool = False
    put_latency: LatencyStats = field(default_factory=LatencyStats)
    get_latency: LatencyStats = field(default_factory=LatencyStats)
