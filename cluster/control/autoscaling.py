"""The autoscaler: per pool, turns observed signals into a desired replica count, honouring the
policy's delays, cooldown, step and bounds. Pure logic on a caller's clock; the controller
applies each decision (adds workers, drains before removing)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from halfmoon.cluster.config import ClusterConfig
from halfmoon.cluster.control.autoscaling_planner import (
    Load,
    Plan,
    ceil_replicas,
    decode_tokens_per_s,
    plan_decode,
    plan_prefill,
    prefill_tokens_per_s,
)
from halfmoon.cluster.control.autoscaling_policy import (
    AutoscalingConfig,
    AutoscalingError,
    DecodePlannerPolicy,
    Policy,
    PrefillPlannerPolicy,
    TargetPolicy,
)
from halfmoon.router.cost_model import CostModel

Pool = Literal["prefill", "decode"]
PLANNER_SIGNALS = ("request_rate_per_s", "mean_input_tokens", "mean_output_tokens")


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """The replica count a pool should have now, and why."""

    desired: int
    reason: str


@dataclass(slots=True)
class _PoolState:
    # (time, value): a target policy's signal, or the replicas the planner asked for.
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    last_change_s: float | None = None
    last_plan: str = ""


class Autoscaler:
    """Decides pool sizes from signals. Target policies get the pool's per-replica signal
    (e.g. {"queue_s": 0.8}); planner policies get {"request_rate_per_s", "mean_input_tokens",
    "mean_output_tokens"} and optionally "mean_cached_tokens", and, without a throughput
    figure, the workers' cost model as it stands with each observation."""

    def __init__(
        self, policies: AutoscalingConfig, ttft_s: float | None = None, tbt_s: float | None = None
    ) -> None:
        self.policies = policies
        self.ttft_s, self.tbt_s = ttft_s, tbt_s
        self._state: dict[str, _PoolState] = {"prefill": _PoolState(), "decode": _PoolState()}

    @classmethod
    def from_config(cls, config: ClusterConfig) -> Autoscaler:
        """An autoscaler for `config`'s policies and SLOs."""
        return cls(config.autoscaling, config.slo.ttft_s, config.slo.tbt_s)

    @property
    def needs_cost_model(self) -> bool:
        """Whether some pool's policy plans from the cost model, so `observe` needs one."""
        policies = (self.policies.prefill, self.policies.decode)
        return any(policy is not None and policy.needs_cost_model for policy in policies)

    def policy(self, pool: Pool) -> Policy:
        """The pool's policy; a pool without one is an AutoscalingError."""
        policy = getattr(self.policies, pool, None) if pool in self._state else None
        if policy is None:
            raise AutoscalingError(
                f"pool {pool!r} has no autoscaling policy; set autoscaling.{pool} in the config"
            )
        return policy

    def observe(
        self, pool: Pool, now: float, signals: Mapping[str, float], cost: CostModel | None = None
    ) -> None:
        """Record one observation of the pool's signals at time `now` (seconds). `cost` is the
        workers' cost model now (the router's live profile), for planners that need it."""
        policy, state = self.policy(pool), self._state[pool]
        if isinstance(policy, TargetPolicy):
            value = float(_need(signals, (policy.signal,), pool)[0])
        else:
            load = Load(*_need(signals, PLANNER_SIGNALS, pool), **_cached(signals))
            plan = self._plan(policy, load, cost)
            value, state.last_plan = float(plan.replicas), plan.reason
        state.samples.append((now, value))
        horizon = now - max(policy.upscale_delay_s, policy.downscale_delay_s)
        # Keep the newest sample at or before the horizon: it proves how long a streak has held.
        while len(state.samples) >= 2 and state.samples[1][0] <= horizon:
            state.samples.popleft()

    def decide(self, pool: Pool, now: float, current_replicas: int) -> ScalingDecision:
        """The replicas the pool should have at `now`. A change starts the cooldown and clears
        the samples, so the next change waits for fresh evidence from the resized pool."""
        policy, state = self.policy(pool), self._state[pool]
        decision = self._decide(policy, state, now, current_replicas)
        if decision.desired != current_replicas:
            state.last_change_s = now
            state.samples.clear()
        return decision

    def _decide(
        self, policy: Policy, state: _PoolState, now: float, current: int
    ) -> ScalingDecision:
        lo, hi = policy.min_replicas, policy.max_replicas
        if current < lo:
            return ScalingDecision(lo, f"{current} replicas is below min_replicas = {lo}")
        if current > hi:
            return ScalingDecision(hi, f"{current} replicas is above max_replicas = {hi}")
        if state.last_change_s is not None and now - state.last_change_s < policy.cooldown_s:
            left = policy.cooldown_s - (now - state.last_change_s)
            return ScalingDecision(current, f"cooldown: {left:.1f}s left")
        wanted = self._proposals(policy, current, state)
        up = _held(wanted, now, policy.upscale_delay_s, lambda n: n > current)
        if up is not None:
            desired = min(current + policy.max_step, min(up), hi)
            return ScalingDecision(desired, self._why(policy, state, current, desired, "up"))
        down = _held(wanted, now, policy.downscale_delay_s, lambda n: n < current)
        if down is not None:
            desired = max(current - policy.max_step, max(down), lo)
            return ScalingDecision(desired, self._why(policy, state, current, desired, "down"))
        return ScalingDecision(current, "steady: no signal held past its delay")

    def _proposals(
        self, policy: Policy, current: int, state: _PoolState
    ) -> list[tuple[float, int]]:
        if isinstance(policy, TargetPolicy):
            # Proportional: the replicas that would bring the per-replica signal to the target.
            return [
                (t, ceil_replicas(current * value / policy.target)) for t, value in state.samples
            ]
        return [(t, int(value)) for t, value in state.samples]

    def _why(self, policy: Policy, state: _PoolState, current: int, desired: int, way: str) -> str:
        if desired == current and way == "up":
            return f"at max_replicas = {policy.max_replicas}: would scale up"
        if desired == current:
            return f"at min_replicas = {policy.min_replicas}: would scale down"
        delay = policy.upscale_delay_s if way == "up" else policy.downscale_delay_s
        if isinstance(policy, TargetPolicy):
            latest = state.samples[-1][1]
            basis = f"{policy.signal} = {latest:.4g} vs target {policy.target:g}"
        else:
            basis = f"planner: {state.last_plan}"
        return f"scale {way} {current} -> {desired}: {basis}, held {delay:g}s"

    def _plan(
        self, policy: PrefillPlannerPolicy | DecodePlannerPolicy, load: Load, cost: CostModel | None
    ) -> Plan:
        if load.request_rate_per_s <= 0:
            # No traffic needs no replica, whatever the cost model says (an idle pool shrinks).
            return Plan(0, "no requests finished in the traffic window")
        if isinstance(policy, PrefillPlannerPolicy):
            return self._plan_prefill(policy, load, cost)
        return self._plan_decode(policy, load, cost)

    def _plan_prefill(
        self, policy: PrefillPlannerPolicy, load: Load, cost: CostModel | None
    ) -> Plan:
        ttft_s = policy.ttft_s or self.ttft_s
        if ttft_s is None:
            raise AutoscalingError("slo_planner for prefill needs ttft_s or the cluster's SLO")
        rate = policy.prefill_tokens_per_s or prefill_tokens_per_s(_required(cost), load)
        return plan_prefill(load, rate, ttft_s, policy.headroom)

    def _plan_decode(self, policy: DecodePlannerPolicy, load: Load, cost: CostModel | None) -> Plan:
        rate = policy.decode_tokens_per_s
        if rate is None:
            tbt_s = policy.tbt_s or self.tbt_s
            if tbt_s is None:
                raise AutoscalingError("slo_planner for decode needs tbt_s or decode_tokens_per_s")
            rate = decode_tokens_per_s(_required(cost), tbt_s, load)
        return plan_decode(load, rate, policy.headroom)


def _held(
    proposals: list[tuple[float, int]], now: float, delay_s: float, holds: Callable[[int], bool]
) -> list[int] | None:
    """The proposals of the current streak where `holds` is true, if it has lasted `delay_s`."""
    start, streak = None, []
    for t, wanted in reversed(proposals):
        if not holds(wanted):
            break
        start = t
        streak.append(wanted)
    if start is None or now - start < delay_s:
        return None
    return streak


def _required(cost: CostModel | None) -> CostModel:
    if cost is None:
        raise AutoscalingError(
            "slo_planner without a tokens_per_s figure needs the workers' cost model; "
            "pass cost= (the router's live profile) to observe or set the throughput in the policy"
        )
    return cost


def _need(signals: Mapping[str, float], names: tuple[str, ...], pool: str) -> list[float]:
    missing = [name for name in names if name not in signals]
    if missing:
        raise AutoscalingError(
            f"signals for pool {pool!r} lack {missing}; its policy reads {list(names)}"
        )
    return [float(signals[name]) for name in names]


def _cached(signals: Mapping[str, float]) -> dict[str, float]:
    cached = signals.get("mean_cached_tokens")
    return {} if cached is None else {"mean_cached_tokens": float(cached)}
