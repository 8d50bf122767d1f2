"""The figures a simulation reports, computed from per-request outcomes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from halfmoon.router.sim.cache_bound import gain_share


def percentile(sorted_values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of already sorted values by linear interpolation; 0 when empty."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


@dataclass(slots=True)
class SimSummary:
    """Latency, SLO, cache and throughput figures of one simulated run."""

    policy: str
    admission: str
    requests: int
    served: int
    rejected: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p50_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    slo_attainment: float
    hit_rate: float
    hit_rate_unbounded: float
    fetches: int
    bypassed: int
    throughput_rps: float
    output_tokens_per_s: float
    makespan_s: float
    ttft_pred_error_mean_s: float
    wall_s: float
    bad_lines: int
    replications: int = 0
    ttft_bound_mean_s: float = 0.0  # the trace's cache-limit bound (cache_bound.py)
    least_loaded_ttft_mean_s: float | None = None  # the same run under least_loaded
    gain_share: float | None = None  # of the possible gain over least_loaded, reached

    def set_baseline(self, least_loaded_ttft_mean_s: float) -> None:
        """Note least_loaded's mean TTFT on the same run, and the share of the possible gain
        over it (down to the cache-limit bound) this run reached."""
        self.least_loaded_ttft_mean_s = least_loaded_ttft_mean_s
        self.gain_share = gain_share(
            least_loaded_ttft_mean_s, self.ttft_mean_s, self.ttft_bound_mean_s
        )

    def to_dict(self) -> dict:
        """Plain dict for JSON output."""
        return asdict(self)

    def text(self) -> str:
        """A short human-readable report."""
        return "\n".join(
            [
                f"policy {self.policy}, admission {self.admission}: {self.requests} requests, "
                f"{self.served} served, {self.rejected} rejected, {self.bad_lines} bad lines",
                f"TTFT mean {self.ttft_mean_s:.3f}s p50 {self.ttft_p50_s:.3f}s "
                f"p90 {self.ttft_p90_s:.3f}s p99 {self.ttft_p99_s:.3f}s",
                f"TBT  mean {self.tbt_mean_s * 1e3:.1f}ms p50 {self.tbt_p50_s * 1e3:.1f}ms "
                f"p90 {self.tbt_p90_s * 1e3:.1f}ms p99 {self.tbt_p99_s * 1e3:.1f}ms",
                f"SLO attainment {self.slo_attainment:.1%} (rejected requests count as missed)",
                f"cache hit rate {self.hit_rate:.1%} of blocks "
                f"(unbounded-cache bound {self.hit_rate_unbounded:.1%}); "
                f"{self.fetches} remote fetches, {self.bypassed} bypassed to decode, "
                f"{self.replications} hot-prefix replications",
                f"throughput {self.throughput_rps:.2f} req/s, {self.output_tokens_per_s:.0f} "
                f"output tok/s over {self.makespan_s:.0f}s simulated",
                self.bound_line(),
                f"TTFT prediction error mean {self.ttft_pred_error_mean_s:.4f}s; "
                f"wall {self.wall_s:.2f}s",
            ]
        )

    def bound_line(self) -> str:
        """The cache-limit bound, and the share of the possible gain over least_loaded."""
        line = (
            f"cache-limit bound: mean TTFT {self.ttft_bound_mean_s:.3f}s (every prefix seen "
            "earlier cached, no queueing)"
        )
        if self.least_loaded_ttft_mean_s is None:
            return line
        share = "n/a" if self.gain_share is None else f"{self.gain_share:.0%}"
        return (
            f"{line}; least_loaded {self.least_loaded_ttft_mean_s:.3f}s: "
            f"{self.policy} reached {share} of the possible gain"
        )
