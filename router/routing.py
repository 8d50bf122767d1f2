"""How the Conductor places one request: the policy's placement with the short-prompt bypass,
the decision it fills in, and the hot-prefix copy it may plan."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from halfmoon.router.bypass import bypass_placement
from halfmoon.router.config import RouterConfig
from halfmoon.router.decision import Decision
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies import Policy
from halfmoon.router.predictor import Location, Predictor, PrefixHits
from halfmoon.router.replication import Replication, Replicator
from halfmoon.router.views import PrefillView


def fill_decision(
    decision: Decision,
    placement: Placement,
    overhead_s: float,
    prefill: Mapping[Hashable, PrefillView],
) -> None:
    """Copy a placement's choice and predictions into `decision` (with the degrees of its
    instances from `prefill` and its decode view; a bypassed prompt prefills on decode)."""
    plan = placement.plan
    decision.prefill_instance = placement.prefill_instance
    decision.decode_instance = placement.decode.instance
    prefills_on = placement.decode if placement.bypass else prefill[placement.prefill_instance]
    decision.prefill_degree = prefills_on.tensor_parallel_size
    decision.decode_degree = placement.decode.tensor_parallel_size
    decision.predicted_ttft_s = placement.ttft_s + overhead_s
    decision.predicted_queue_s = placement.queue_s
    decision.predicted_tbt_s = placement.tbt_s
    decision.cached_tokens = plan.cached_tokens
    decision.local_cached_tokens = plan.local_cached_tokens
    decision.fetch_from = plan.fetch_from
    decision.fetch_tokens = plan.fetch_tokens
    decision.bypass = placement.bypass
    decision.candidates = placement.candidates


def place_with_bypass(
    policy: Policy, config: RouterConfig, ctx: PlacementContext, tbt_slo_s: float | None
) -> Placement:
    """The policy's placement, or the short-prompt bypass where the Conductor finds it better."""
    placement = policy.place(ctx)
    if policy.name != "conductor" or config.bypass_max_tokens <= 0:
        return placement
    stall_s = tbt_slo_s if tbt_slo_s is not None else config.bypass_max_stall_s
    return bypass_placement(ctx, placement, config.bypass_max_tokens, stall_s) or placement


def tbt_predictor(predictor: Predictor, admission: str, now: float, decode_tokens: int):
    if admission == "prediction_early_rejection":
        return lambda view, when_s: predictor.tbt_at(view, now, when_s, decode_tokens)
    return lambda view, when_s: predictor.tbt_with_pending(view, decode_tokens)


def make_replicator(config: RouterConfig) -> Replicator | None:
    """The hot-prefix replicator, when `config.replicate` asks for one."""
    return Replicator(config) if config.replicate else None


def plan_replication(
    replicator: Replicator,
    ctx: PlacementContext,
    placement: Placement,
    locations: dict[Location, int],
    own: PrefixHits,
    prefill: Mapping[Hashable, PrefillView],
) -> Replication | None:
    """A hot prefix copied into an idle prefill worker's own pages (`own`: the blocks each
    instance holds itself, not counting its node's store), or None."""
    served_by = None if placement.bypass else placement.prefill_instance
    fetched = placement.plan.fetch_from is not None and not placement.bypass
    keys = ctx.request.block_keys
    return replicator.plan(keys, locations, own, prefill, served_by, fetched, ctx.now)
