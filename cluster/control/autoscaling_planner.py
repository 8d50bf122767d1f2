"""SLO planning (like NVIDIA Dynamo's planner): the replicas each pool needs for the recent load,
from profiled per-replica throughput. Pure functions of their arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

from halfmoon.cluster.control.autoscaling_policy import AutoscalingError
from halfmoon.router.cost_model import CostModel

# Float noise must not turn an exact 3.0 replicas into 4.
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Load:
    """Recent traffic: arrival rate and mean lengths over the planner's window."""

    request_rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    mean_cached_tokens: float = 0.0

    @property
    def new_tokens(self) -> float:
        """Prompt tokens per request that prefill must compute (the rest come from cache)."""
        return max(self.mean_input_tokens - self.mean_cached_tokens, 0.0)


@dataclass(frozen=True, slots=True)
class Plan:
    """Replicas one pool needs, and how that number was reached."""

    replicas: int
    reason: str


def plan_prefill(load: Load, tokens_per_s: float, ttft_s: float, headroom: float) -> Plan:
    """Prefill replicas keeping mean TTFT = prefill / (1 - utilization) under `ttft_s`
    (each replica an M/M/1 queue of prefills), times `headroom`."""
    work = load.request_rate_per_s * load.new_tokens
    service_s = load.new_tokens / tokens_per_s
    if service_s >= ttft_s:
        # No replica count can help a prompt that alone outlasts the target; plan for throughput.
        replicas = ceil_replicas(headroom * work / tokens_per_s)
        return Plan(
            replicas,
            f"TTFT target {ttft_s:g}s unreachable: one prefill takes {service_s:.3g}s; "
            f"sized for throughput ({work:.4g} tokens/s)",
        )
    max_utilization = 1.0 - service_s / ttft_s
    replicas = ceil_replicas(headroom * work / (tokens_per_s * max_utilization))
    return Plan(
        replicas,
        f"{work:.4g} prompt tokens/s at <= {max_utilization:.0%} utilization of "
        f"{tokens_per_s:.4g} tokens/s per replica, x{headroom:g} headroom",
    )


def plan_decode(load: Load, tokens_per_s: float, headroom: float) -> Plan:
    """Decode replicas whose generation rate at the TBT target covers the load, x `headroom`."""
    work = load.request_rate_per_s * load.mean_output_tokens
    replicas = ceil_replicas(headroom * work / tokens_per_s)
    return Plan(
        replicas,
        f"{work:.4g} output tokens/s over {tokens_per_s:.4g} tokens/s per replica, "
        f"x{headroom:g} headroom",
    )


def prefill_tokens_per_s(cost: CostModel, load: Load) -> float:
    """Prompt tokens/s one replica computes for the load's mean prompt."""
    new = max(load.new_tokens, 1.0)
    seconds = cost.prefill_time(new, load.mean_cached_tokens)
    return new / _positive(seconds, f"a prefill of {new:.0f} tokens")


def decode_tokens_per_s(cost: CostModel, tbt_s: float, load: Load) -> float:
    """Tokens/s one replica generates with the largest batch whose step fits in `tbt_s`,
    each sequence holding the load's mean context (prompt + half the output)."""
    context = load.mean_input_tokens + load.mean_output_tokens / 2
    const_s, per_seq_s, per_kv_token_s = cost.decode_coef
    per_request_s = per_seq_s + per_kv_token_s * context
    _positive(per_request_s, f"each sequence of {context:.0f} tokens in a decode step")
    batch = math.floor((tbt_s - const_s) / per_request_s + _EPS)
    if batch < 1:
        raise AutoscalingError(
            f"one decode step takes {cost.decode_step_time(1, context):.4g}s > TBT target "
            f"{tbt_s:g}s; raise the TBT target or give decode_tokens_per_s"
        )
    step_s = cost.decode_step_time(batch, batch * context)
    return batch / _positive(step_s, f"a decode step of {batch} sequences")


def _positive(seconds: float, what: str) -> float:
    """`seconds` from the cost model, if positive: a fit that predicts no time at all is off
    the range it was fitted on, and would plan for infinite throughput."""
    if seconds <= 0:
        raise AutoscalingError(
            f"the cost model predicts {seconds:.3g}s for {what}; "
            "its fit does not cover this load: give the pool's tokens_per_s in its policy"
        )
    return seconds


def ceil_replicas(replicas: float) -> int:
    """Whole replicas covering `replicas`, ignoring float noise above a whole number."""
    return max(math.ceil(replicas - _EPS), 0)
