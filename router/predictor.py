"""Predicted TTFT on a prefill instance and TBT on a decode instance, from the cost model."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from halfmoon.router.cost_model import CostModel
from halfmoon.router.profile import Profile
from halfmoon.router.views import DecodeView

Location = tuple[Hashable, str]


@dataclass(slots=True)
class PrefixHits:
    """How many leading blocks each instance holds locally, and the best copy anywhere."""

    local_blocks: dict[Hashable, int]
    best: tuple[Location, int] | None
    runner_up: tuple[Location, int] | None

    def remote_for(self, instance: Hashable) -> tuple[Location, int] | None:
        """The deepest prefix held somewhere other than `instance`."""
        if self.best is not None and self.best[0][0] != instance:
            return self.best
        return self.runner_up


def summarize_hits(locations: dict[Location, int]) -> PrefixHits:
    """Fold the index's per-(instance, tier) depths into per-instance and best-remote depths."""
    local: dict[Hashable, int] = {}
    best: tuple[Location, int] | None = None
    runner_up: tuple[Location, int] | None = None
    for location, depth in locations.items():
        instance = location[0]
        if depth > local.get(instance, 0):
            local[instance] = depth
        if best is None or depth > best[1]:
            if best is not None and best[0][0] != instance:
                runner_up = best
            best = (location, depth)
        elif instance != best[0][0] and (runner_up is None or depth > runner_up[1]):
            runner_up = (location, depth)
    return PrefixHits(local, best, runner_up)


@dataclass(slots=True)
class PrefillPlan:
    """How to prefill a prompt given what is cached where, and its predicted seconds of work."""

    work_s: float
    cached_tokens: int
    local_cached_tokens: int
    fetch_from: Location | None = None
    fetch_tokens: int = 0


class Predictor:
    """Turns cached prefix depths and instance views into predicted seconds."""

    def __init__(self, profile: Profile, block_size: int, fetch_margin_s: float) -> None:
        self.profile = profile
        self.cost: CostModel = profile.cost
        self.block_size = block_size
        self.fetch_margin_s = fetch_margin_s

    def cached_tokens(self, num_blocks: int, num_prompt_tokens: int) -> int:
        """Tokens served from `num_blocks` cached blocks; the last token is always computed."""
        return max(min(num_blocks * self.block_size, num_prompt_tokens - 1), 0)

    def local_plan(self, local_blocks: int, num_prompt_tokens: int) -> PrefillPlan:
        """Prefill using only the `local_blocks` leading blocks the instance already holds."""
        cached = self.cached_tokens(local_blocks, num_prompt_tokens)
        work = self.cost.prefill_time(num_prompt_tokens - cached, cached)
        return PrefillPlan(work, cached, cached)

    def best_plan(
        self, local_blocks: int, remote: tuple[Location, int] | None, num_prompt_tokens: int
    ) -> PrefillPlan:
        """The local plan, or fetch a deeper remote prefix first when that wins by the margin."""
        plan = self.local_plan(local_blocks, num_prompt_tokens)
        if remote is None:
            return plan
        remote_cached = self.cached_tokens(remote[1], num_prompt_tokens)
        fetch_tokens = remote_cached - plan.cached_tokens
        if fetch_tokens <= 0:
            return plan
        work = self.cost.prefill_time(num_prompt_tokens - remote_cached, remote_cached)
        work += self.profile.transfer_time(fetch_tokens, remote=True)
        if plan.work_s - work < self.fetch_margin_s:
            return plan
        return PrefillPlan(work, remote_cached, plan.cached_tokens, remote[0], fetch_tokens)

    def tbt_now(self, view: DecodeView, num_tokens: int) -> float:
        """Step time if the request joined the batch the worker last reported."""
        return self.cost.decode_step_time(view.batch_size + 1, view.kv_tokens + num_tokens)

    def tbt_with_pending(self, view: DecodeView, num_tokens: int) -> float:
        """Step time once every request already placed here (and this one) has joined."""
        return self.cost.decode_step_time(
            view.batch_size + view.num_pending + 1,
            view.kv_tokens + view.pending_tokens + num_tokens,
        )

    def tbt_at(self, view: DecodeView, now: float, when_s: float, num_tokens: int) -> float:
        """Step time at `when_s`, from the admitted requests predicted to be running then."""
        step_s = self.cost.decode_step_time(max(view.batch_size, 1), view.kv_tokens)
        batch, kv = view.load_at(when_s, now, step_s)
        return self.cost.decode_step_time(batch + 1, kv + num_tokens)
