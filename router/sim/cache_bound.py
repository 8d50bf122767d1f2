"""The cache-limit bound of a trace: the mean TTFT no routing policy can beat, and how much of
the possible gain over a baseline a policy reached."""

from __future__ import annotations

from halfmoon.router.profile import Profile
from halfmoon.router.sim.trace import TraceRecord


def seen_prefix_blocks(records: list[TraceRecord]) -> list[int]:
    """Per record, how many of its leading blocks an earlier record of the trace held."""
    seen: set[int] = set()
    depths = []
    for record in records:
        depth = 0
        while depth < len(record.hash_ids) and record.hash_ids[depth] in seen:
            depth += 1
        depths.append(depth)
        seen.update(record.hash_ids)
    return depths


def cache_bound_ttft_s(records: list[TraceRecord], profile: Profile, block_size: int) -> float:
    """Mean TTFT if every prefix seen earlier in the trace were cached where the request runs
    and nothing queued: the per-request overhead plus the prefill of the uncached tokens."""
    if not records:
        return 0.0
    total_s = 0.0
    for record, depth in zip(records, seen_prefix_blocks(records), strict=True):
        cached = max(min(depth * block_size, record.num_prompt_tokens - 1), 0)
        new = record.num_prompt_tokens - cached
        total_s += profile.request_overhead_s + profile.cost.prefill_time(new, cached)
    return total_s / len(records)


def gain_share(baseline_s: float, policy_s: float, bound_s: float) -> float | None:
    """The share of the possible gain over `baseline_s` (down to `bound_s`) that `policy_s`
    reached: 1 at the bound, 0 at the baseline; None when the baseline is at the bound."""
    possible_s = baseline_s - bound_s
    if possible_s <= 0.0:
        return None
    return (baseline_s - policy_s) / possible_s
