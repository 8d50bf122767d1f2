"""The Conductor: the global router that places each request on a prefill and a decode instance."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence

from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import step_sample
from halfmoon.router.decision import Decision
from halfmoon.router.degree import instance_degree, measures_side
from halfmoon.router.online_fit import OnlineRefit, RecentMean
from halfmoon.router.placed import Hold, PlacedRequests, hold_placement
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies import make_policy
from halfmoon.router.prediction_error import PredictionErrorLog, PredictionErrorStats
from halfmoon.router.predictor import Predictor, PrefixHits, summarize_hits
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile, profile_to_dict
from halfmoon.router.replication import Replication
from halfmoon.router.request import RouteRequest
from halfmoon.router.routing import (
    RouteAsk,
    fill_decision,
    make_replicator,
    no_room_reason,
    place_with_bypass,
    plan_replication,
    tbt_predictor,
)
from halfmoon.router.ttft_bound import TtftBound
from halfmoon.router.views import Admitted, DecodeView, PrefillView

HANDOFF_WINDOW = 256  # recent disaggregated requests whose hand-off time `handoff_s` averages


class Conductor:
    """Routes requests by predicted TTFT and TBT; fed by instance reports and block events."""

    def __init__(
        self,
        config: RouterConfig,
        profile: Profile,
        index: PrefixIndex | None = None,
        colocated: bool = False,
    ) -> None:
        """`colocated`: every instance is registered as both a prefill and a decode instance
        of the same name, and a request prefills and decodes on one of them."""
        self.config = config
        self.colocated = colocated
        # The router refits its own copy, so the profile it was given stays as loaded.
        cost = dataclasses.replace(profile.cost)
        self.profile = dataclasses.replace(profile, cost=cost)
        self.index = index if index is not None else PrefixIndex()
        self.predictor = Predictor(self.profile, config.block_size, config.fetch_margin_s)
        self.refit = OnlineRefit(cost)
        self.policy = make_policy(config.policy, config.seed)
        self.prefill: dict[Hashable, PrefillView] = {}
        self.decode: dict[Hashable, DecodeView] = {}
        self.errors = PredictionErrorLog()
        self.placed = PlacedRequests(config.explain_capacity)
        self._output_tokens_sum = 0
        self._output_tokens_count = 0
        self._handoffs = RecentMean(HANDOFF_WINDOW)
        self.replicator = make_replicator(config)
        self._with_nodes: list[PrefillView] = []  # prefill views with a store node of their own

    def add_prefill(
        self, instance: Hashable, node: str | None = None, tensor_parallel_size: int | None = None
    ) -> PrefillView:
        """Register a prefill instance; `node` names the store node whose host tier it loads
        prefixes from without a fetch (None: its own blocks only, as in the simulator), and
        `tensor_parallel_size` its degree (None: the profile's prefill degree)."""
        self.remove_prefill_view(instance)
        shared = self.profile.cost.chunk_tokens > 0  # a chunking engine shares its steps
        degree = instance_degree(self.profile, "prefill", instance, tensor_parallel_size)
        view = self.prefill[instance] = PrefillView(instance, node, shared, degree)
        if node is not None:
            self._with_nodes.append(view)
        return view

    def add_decode(
        self,
        instance: Hashable,
        capacity_tokens: int | None = None,
        tensor_parallel_size: int | None = None,
    ) -> DecodeView:
        """Register a decode instance with `capacity_tokens` of KV (default: the profile's) at
        `tensor_parallel_size` (None: the profile's decode degree)."""
        capacity = capacity_tokens or self.profile.decode_kv_capacity_tokens
        degree = instance_degree(self.profile, "decode", instance, tensor_parallel_size)
        view = self.decode[instance] = DecodeView(instance, capacity, degree)
        return view

    def remove_instance(self, instance: Hashable) -> None:
        """Forget an instance that died or left, and every block the index held for it."""
        self.remove_prefill_view(instance)
        self.decode.pop(instance, None)
        self.index.drop_instance(instance)

    def remove_prefill_view(self, instance: Hashable) -> None:
        view = self.prefill.pop(instance, None)
        if view is not None and view.node is not None:
            self._with_nodes.remove(view)

    @property
    def mean_output_tokens(self) -> int:
        """Mean output length of finished requests (the configured default before any)."""
        if self._output_tokens_count == 0:
            return self.config.default_output_tokens
        return max(self._output_tokens_sum // self._output_tokens_count, 1)

    def route(self, request: RouteRequest, now: float) -> Decision:
        """Place `request` arriving at `now`, or reject it with the predicted figure and SLO."""
        ask = RouteAsk.of(request, self.config, self.mean_output_tokens)
        decision = Decision(request.request_id, self.policy.name)
        decode_views = [v for v in self.decode.values() if v.free_kv_tokens >= ask.reserve]
        if not self.prefill or not decode_views:
            decision.rejected = True
            decision.reason = no_room_reason(bool(self.prefill), self.decode.values(), ask.reserve)
            return self._remember(decision)
        locations = self.index.longest_prefix(request.block_keys)
        own = summarize_hits(locations)
        ctx = self._context(request, now, own, decode_views, ask.decode_tokens)
        placement = self._place(ctx, ask.tbt_slo_s)
        handoff_s = 0.0 if placement.bypass else self.profile.handoff_s
        overhead_s = self.profile.request_overhead_s + handoff_s
        fill_decision(decision, placement, overhead_s, self.prefill)
        decision.reason = ask.rejection(
            self.config, placement, self.predictor, decision, self._ttft_bound(now)
        )
        decision.rejected = bool(decision.reason)
        if decision.rejected:
            return self._remember(decision)
        admitted = Admitted(ask.decode_tokens, now + placement.ttft_s, ask.expected_output)
        queue = None if placement.bypass else self.prefill[placement.prefill_instance]
        hold = hold_placement(
            placement, queue, request.num_prompt_tokens, now, admitted, ask.reserve
        )
        if self.replicator is not None:
            copy = plan_replication(self.replicator, ctx, placement, locations, own, self.prefill)
            decision.replications += [copy] if copy is not None else []
        return self._remember(decision, hold)

    def _ttft_bound(self, now: float) -> TtftBound:
        """router.max_ttft_s now, scaled as recent predictions fell short."""
        return TtftBound.of(self.config.max_ttft_s, self.errors, self.prefill, now)

    def on_replicated(self, replication: Replication) -> None:
        """A copy planned by `route` landed (or failed); the index learns of it from events."""
        if self.replicator is not None:
            self.replicator.on_replicated(replication)

    def apply_block_events(self, events: Iterable[BlockEvent]) -> None:
        """Blocks that tiers stored or evicted, as the prefix index learns of them."""
        for event in events:
            self.index.apply(event)

    @property
    def num_indexed_blocks(self) -> int:
        """Blocks the prefix index holds, over every instance and tier."""
        return len(self.index)

    def explain(self, request_id: str) -> str:
        """The candidates, their predictions and why one won, for a recent request."""
        return self.placed.explain(request_id)

    def decision(self, request_id: str) -> Decision | None:
        """The remembered decision for `request_id`, if still kept."""
        return self.placed.decision(request_id)

    def on_prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished (its first token is out): the work queued behind it on its
        instance is still to do, from `now`."""
        hold = self.placed.hold_of(request_id)
        if hold is not None and self._counted(hold):
            hold.queue.finish(hold.job, now)
            hold.queue = None

    def report_prefill(
        self, instance: Hashable, num_requests: int, tokens_left: int, as_of: float
    ) -> None:
        """A prefill worker's own count of the requests it holds and the prompt tokens it has
        still to compute, taken at `as_of` (the end of its last step): when it holds every
        request sent to it (none on its way), its outstanding work is re-estimated from them."""
        view = self.prefill.get(instance)
        if view is not None:
            view.reconcile(num_requests, self.profile.cost.prefill_time(tokens_left, 0), as_of)

    def on_decode_join(self, request_id: str, now: float) -> None:
        """The request's KV landed and it joined the decode batch."""
        hold = self.placed.hold_of(request_id)
        if hold is not None:
            hold.decode.join(hold.admitted, now)

    def report_decode(self, instance: Hashable, batch_size: int, kv_tokens: int) -> None:
        """A decode worker's report of its running batch (ignored once it was removed)."""
        view = self.decode.get(instance)
        if view is not None:
            view.report(batch_size, kv_tokens)

    def on_finish(self, request_id: str, now: float, output_tokens: int) -> None:
        """The request finished, was cancelled or hit its deadline: release its reservation."""
        if self.on_abandon(request_id, now):
            self._output_tokens_sum += output_tokens
            self._output_tokens_count += 1

    def on_abandon(self, request_id: str, now: float) -> bool:
        """Release the request's reservation and unfinished prefill work without counting it
        (its worker died and it is routed again); False if it held none."""
        placed = self.placed.release(request_id)
        if placed is None:
            return False
        hold = placed.hold
        hold.decode.leave(hold.admitted, hold.reserve_tokens)
        if self._counted(hold):
            hold.queue.drop(hold.job, now)
        return True

    def _counted(self, hold: Hold) -> bool:
        """Whether the hold's prefill work is still in a registered view's line (not in one
        since removed, or re-added afresh)."""
        queue = hold.queue
        return queue is not None and self.prefill.get(queue.instance) is queue

    def observe_prefill(self, num_prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A measured prefill (compute seconds, cached tokens really reused), for the refit."""
        self.refit.observe_prefill(num_prompt_tokens - cached_tokens, cached_tokens, seconds)

    def observe_decode_step(self, batch_size: int, kv_tokens: int, seconds: float) -> None:
        """A measured decode step time, for the online refit."""
        self.refit.observe_decode_step(batch_size, kv_tokens, seconds)

    def observe_prefill_step(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """A measured engine step that computed only prefill `chunks` of (new tokens, tokens
        before them), for the online refit."""
        self.refit.observe_prefill_step(chunks, seconds)

    def observe_step(self, step, tensor_parallel_size: int | None = None) -> None:
        """A worker's `engine.llm_engine.StepTiming`: pure prefill and pure decode steps
        refine the cost model; mixed steps (a bypassed prefill beside decodes) and steps of a
        worker at another degree than the profile's side of that step are skipped."""
        sample = step_sample(step)
        if sample is None or not measures_side(self.profile, sample[0], tensor_parallel_size):
            return
        kind, shape, step_s = sample
        if kind == "prefill":
            self.observe_prefill_step(shape, step_s)
        else:
            self.observe_decode_step(*shape, step_s)

    def set_request_overhead(self, seconds: float) -> None:
        """A calibrated per-request overhead (idle pipeline, outside prefill and hand-off)."""
        self.profile.request_overhead_s = max(seconds, 0.0)

    def observe_handoff(self, seconds: float) -> None:
        """A disaggregated request's hand-off (its prefill's compute end to its first token
        out): the profile's `handoff_s` follows the mean of the recent ones."""
        self.profile.handoff_s = max(self._handoffs.add(max(seconds, 0.0)), 0.0)

    def observe_ttft(self, request_id: str, actual_s: float) -> None:
        """The measured TTFT of a routed request, recorded next to its prediction."""
        placed = self.placed.holding(request_id)
        if placed is not None:
            self.errors.record(placed.decision.predicted_ttft_s, actual_s)

    def observe_first_token(self, request_id: str, ttft_s: float, handoff_s: float | None) -> None:
        """A live request's first token: its TTFT, and (disaggregated) its hand-off, from its
        prefill's compute end to its first token out (the queue before is predicted apart)."""
        self.observe_ttft(request_id, ttft_s)
        if handoff_s is not None:
            self.observe_handoff(handoff_s)

    def prefill_time_s(self, num_tokens: int) -> float:
        """The cost model's prefill time of `num_tokens` uncached tokens."""
        return self.profile.cost.prefill_time(num_tokens, 0)

    def current_profile(self) -> Profile:
        """The profile as it stands: measured at start, calibrated, refit online."""
        return self.profile

    def reserved_kv_tokens(self, instance: Hashable) -> int | None:
        """KV tokens held back for requests placed on decode `instance` (None if unknown)."""
        view = self.decode.get(instance)
        return None if view is None else view.reserved_tokens

    def pool_load(self, now: float) -> tuple[float, float]:
        """(summed predicted prefill queue seconds, worst predicted decode TBT now)."""
        queue_s = sum(view.wait_s(now) for view in self.prefill.values())
        tbt_s = max((self.predictor.tbt_now(v, 0) for v in self.decode.values()), default=0.0)
        return queue_s, tbt_s

    def prediction_error(self) -> PredictionErrorStats:
        """How far predicted TTFT was from the observed TTFT."""
        return self.errors.stats()

    def snapshot(self) -> dict:
        """The settings, the profile as it stands and the TTFT prediction error, as plain data."""
        return {
            "policy": self.config.policy,
            "router": dataclasses.asdict(self.config),
            "profile": profile_to_dict(self.profile),
            "ttft_prediction_error": dataclasses.asdict(self.prediction_error()),
        }

    def _context(
        self, request: RouteRequest, now: float, own: PrefixHits, decode_views: list[DecodeView],
        decode_tokens: int,
    ) -> PlacementContext:  # fmt: skip
        """What a policy sees: a node's store counts as local to its workers (copies still go
        to a worker's own pages); colocated, only instances with room and their own cache."""
        hits = own.with_nodes(self._with_nodes) if self._with_nodes else own
        prefill_views = list(self.prefill.values())
        if self.colocated:
            prefill_views = [self.prefill[v.instance] for v in decode_views]
            hits = PrefixHits(hits.local_blocks, None, None)
        predictor, admission = self.predictor, self.config.admission
        tbt = tbt_predictor(predictor, admission, now, decode_tokens)
        return PlacementContext(
            request, now, hits, prefill_views, decode_views, predictor, decode_tokens, tbt
        )

    def _place(self, ctx: PlacementContext, tbt_slo_s: float | None) -> Placement:
        """The policy's placement (with the short-prompt bypass where it wins); colocated,
        the request decodes where it prefills."""
        if not self.colocated:
            return place_with_bypass(self.policy, self.config, ctx, tbt_slo_s)
        placement = self.policy.place(ctx)
        placement.decode = self.decode[placement.prefill_instance]
        placement.tbt_s = ctx.tbt(placement.decode, ctx.now + placement.ttft_s)
        return placement

    def _remember(self, decision: Decision, hold: Hold | None = None) -> Decision:
        self.placed.remember(decision, hold)
        return decision
