"""What one run of the `Simulation` counted (each request's outcome, the cache hits, fetches
and bypasses) and the summary figures made from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from halfmoon.router.config import RouterConfig
from halfmoon.router.profile import Profile
from halfmoon.router.sim.cache_bound import cache_bound_ttft_s
from halfmoon.router.sim.summary import SimSummary, percentile
from halfmoon.router.sim.trace import TraceRecord, unbounded_hit_rate


@dataclass(slots=True)
class Outcome:
    """One request's latencies (-1: not yet known) or its rejection at arrival."""

    arrival_s: float
    ttft_s: float = -1.0
    tbt_s: float = -1.0
    rejected: bool = False


@dataclass(slots=True)
class Tally:
    """Outcomes by request id, in arrival order, and the run's cache and placement counts."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    hit_blocks: int = 0
    total_blocks: int = 0
    fetches: int = 0
    bypassed: int = 0

    def latencies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-request TTFT and TBT seconds in trace order (inf when rejected)."""
        outcomes = [self.outcomes[str(i)] for i in range(len(self.outcomes))]
        ttft = np.array([np.inf if o.rejected else o.ttft_s for o in outcomes])
        tbt = np.array([np.inf if o.rejected else max(o.tbt_s, 0.0) for o in outcomes])
        return ttft, tbt


@dataclass(slots=True, frozen=True)
class RunEnd:
    """How a run ended: the router's settings and the instances' profile it ran with, when
    its last decode instance went idle, the router's TTFT prediction error and the wall time."""

    config: RouterConfig
    profile: Profile
    last_s: float
    ttft_pred_error_mean_s: float
    wall_s: float


def summarize(tally: Tally, records: list[TraceRecord], end: RunEnd) -> SimSummary:
    """The run's latency, SLO, cache and throughput figures."""
    config, outcomes = end.config, list(tally.outcomes.values())
    served = [o for o in outcomes if not o.rejected]
    ttfts = sorted(o.ttft_s for o in served)
    tbts = sorted(o.tbt_s for o in served if o.tbt_s >= 0)
    makespan = _makespan_s(records, served, end.last_s)
    output_tokens = sum(
        records[int(rid)].num_output_tokens for rid, o in tally.outcomes.items() if not o.rejected
    )
    return SimSummary(
        policy=config.policy,
        admission=config.admission,
        requests=len(outcomes),
        served=len(served),
        rejected=len(outcomes) - len(served),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p90_s=percentile(ttfts, 0.9),
        ttft_p99_s=percentile(ttfts, 0.99),
        tbt_mean_s=sum(tbts) / len(tbts) if tbts else 0.0,
        tbt_p50_s=percentile(tbts, 0.5),
        tbt_p90_s=percentile(tbts, 0.9),
        tbt_p99_s=percentile(tbts, 0.99),
        slo_attainment=_met(served, config) / max(len(outcomes), 1),
        hit_rate=tally.hit_blocks / tally.total_blocks if tally.total_blocks else 0.0,
        hit_rate_unbounded=unbounded_hit_rate(records),
        fetches=tally.fetches,
        bypassed=tally.bypassed,
        throughput_rps=len(served) / makespan,
        output_tokens_per_s=output_tokens / makespan,
        makespan_s=makespan,
        ttft_pred_error_mean_s=end.ttft_pred_error_mean_s,
        wall_s=end.wall_s,
        bad_lines=0,
        ttft_bound_mean_s=cache_bound_ttft_s(records, end.profile, config.block_size),
    )


def _met(served: list[Outcome], config: RouterConfig) -> int:
    """Served requests within both SLOs (an unset SLO is always met)."""
    ttft_slo = config.ttft_slo_s or float("inf")
    tbt_slo = config.tbt_slo_s or float("inf")
    return sum(1 for o in served if o.ttft_s <= ttft_slo and o.tbt_s <= tbt_slo)


def _makespan_s(records: list[TraceRecord], served: list[Outcome], last_s: float) -> float:
    """From the first arrival to the last first token or decode step, whichever is later."""
    first = min((r.arrival_s for r in records), default=0.0)
    last = max((o.arrival_s + o.ttft_s for o in served), default=first)
    return max(max(last, last_s) - first, 1e-9)
