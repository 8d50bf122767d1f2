"""Predicted TTFT on a prefill instance and TBT on a decode instance, from the cost model."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from halfmoon.router.cost_model import CostModel
from halfmoon.router.profile import Profile
from halfmoon.router.views import DecodeView

Location = tuple[Hashable, str]
SHARED_TIER = "redis"  # reachable from every node, at a transfer's cost: never local
PRIVATE_TIER = "device"  # a worker's own pages: local to it, never a fetch's source


@dataclass(slots=True)
class PrefixHits:
    """How many leading blocks each instance holds locally, and the best copy anywhere.

    `near_blocks`: of an instance's local blocks, how many are not in its own pages but in
    the host tier of its node's store (loaded at host-to-device speed, no network)."""

    local_blocks: dict[Hashable, int]
    best: tuple[Location, int] | None
    runner_up: tuple[Location, int] | None
    near_blocks: dict[Hashable, int] = field(default_factory=dict)
    deepest: int = 0  # the most leading blocks any location holds, in any tier

    def with_nodes(self, views) -> PrefixHits:
        """These hits with the store of each prefill view's node (`view.node`) counted as
        local to it, the blocks beyond its own pages as near."""
        local, near = dict(self.local_blocks), {}
        for view in views:
            depth, own = local.get(view.node, 0), local.get(view.instance, 0)
            if depth > own:
                local[view.instance], near[view.instance] = depth, depth - own
        return PrefixHits(local, self.best, self.runner_up, near, self.deepest)

    def remote_for(self, instance: Hashable) -> tuple[Location, int] | None:
        """The deepest prefix held somewhere other than `instance`."""
        if self.best is not None and self.best[0][0] != instance:
            return self.best
        return self.runner_up


def summarize_hits(locations: dict[Location, int]) -> PrefixHits:
    """Fold the index's per-(instance, tier) depths into per-instance and best-remote depths
    (a block in the shared tier is local to no instance: it is fetched; one in a worker's
    private pages is local to it alone: it is never fetched)."""
    local: dict[Hashable, int] = {}
    best: tuple[Location, int] | None = None
    runner_up: tuple[Location, int] | None = None
    deepest = max(locations.values(), default=0)
    for location, depth in locations.items():
        instance = location[0]
        if depth > local.get(instance, 0) and location[1] != SHARED_TIER:
            local[instance] = depth
        if location[1] == PRIVATE_TIER:
            continue
        if best is None or depth > best[1]:
            if best is not None and best[0][0] != instance:
                runner_up = best
            best = (location, depth)
        elif instance != best[0][0] and (runner_up is None or depth > runner_up[1]):
            runner_up = (location, depth)
    return PrefixHits(local, best, runner_up, deepest=deepest)


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

    def local_plan(
        self, local_blocks: int, num_prompt_tokens: int, near_blocks: int = 0
    ) -> PrefillPlan:
        """Prefill using only the `local_blocks` leading blocks the instance already holds,
        the last `near_blocks` of them loaded from its node's host tier first."""
        cached = self.cached_tokens(local_blocks, num_prompt_tokens)
        work = self.cost.prefill_time(num_prompt_tokens - cached, cached)
        if near_blocks:
            own = self.cached_tokens(local_blocks - near_blocks, num_prompt_tokens)
            work += self.profile.transfer_time(cached - own, remote=False)
        return PrefillPlan(work, cached, cached)

    def best_plan(
        self,
        local_blocks: int,
        remote: tuple[Location, int] | None,
        num_prompt_tokens: int,
        near_blocks: int = 0,
    ) -> PrefillPlan:
        """The local plan, or fetch a deeper remote prefix first when that wins by the margin."""
        plan = self.local_plan(local_blocks, num_prompt_tokens, near_blocks)
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
