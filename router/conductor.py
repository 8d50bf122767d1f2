"""The Conductor: the global router that places each request on a prefill and a decode instance.

Three kinds of input reach it: `route` for each request, `on_event` for what then happens to a
placed request (router/events.py) and `observe` for what instances report (router/reports.py);
instances come and go with `add_instance` / `remove_instance`; `explain`, `snapshot` and `view`
answer questions without changing it. The live router and the simulator drive the same code."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from halfmoon.router.admission import RouteAsk
from halfmoon.router.conductor_view import ConductorView
from halfmoon.router.config import RouterConfig, check_choice
from halfmoon.router.decision import Decision
from halfmoon.router.estimates import Estimates
from halfmoon.router.events import (
    Abandoned,
    DecodeJoined,
    Event,
    Finished,
    FirstToken,
    PrefillDone,
    Replicated,
)
from halfmoon.router.fleet import ROLES, Fleet, Registered
from halfmoon.router.placed import Hold, PlacedRequests, hold_placement
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies import make_policy
from halfmoon.router.predictor import Location, PrefixHits, summarize_hits
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile, profile_to_dict
from halfmoon.router.replication import Replication
from halfmoon.router.reports import BlockEvents, DecodeLoad, PrefillLoad, Report
from halfmoon.router.request import RouteRequest
from halfmoon.router.routing import (
    fill_decision,
    make_replicator,
    place_with_bypass,
    plan_replication,
    tbt_predictor,
)
from halfmoon.router.ttft_bound import TtftBound
from halfmoon.router.views import DecodeView


class Conductor:
    """Routes requests by predicted TTFT and TBT; fed by request events and instance reports."""

    def __init__(
        self,
        config: RouterConfig,
        profile: Profile,
        index: PrefixIndex | None = None,
        colocated: bool = False,
    ) -> None:
        """`index`: the prefix index to keep (the simulator's instances write theirs into it);
        `colocated`: every instance is both a prefill and a decode instance of one name, and a
        request prefills and decodes on one of them."""
        self._config = config
        self._colocated = colocated
        self._estimates = Estimates(config, profile)
        self._index = index if index is not None else PrefixIndex()
        self._fleet = Fleet(self._estimates.profile)
        self._policy = make_policy(config.policy, config.seed)
        self._placed = PlacedRequests(config.explain_capacity)
        self._replicator = make_replicator(config)
        self._view = ConductorView(
            self._estimates, self._fleet, self._placed, self._index, self._replicator
        )
        self._handlers = {
            PrefillDone: self._prefill_done,
            DecodeJoined: self._decode_joined,
            FirstToken: self._first_token,
            Finished: self._finished,
            Abandoned: self._abandoned,
            Replicated: self._replicated,
        }

    def route(self, request: RouteRequest, now: float) -> Decision:
        """Place `request` arriving at `now`, or reject it with the predicted figure and SLO."""
        ask = RouteAsk.of(request, now, self._config, self._estimates.mean_output_tokens)
        decision = Decision(request.request_id, self._policy.name)
        decode_views = self._fleet.decode_with_room(ask.reserve)
        if not self._fleet.prefill or not decode_views:
            decision.rejected, decision.reason = True, self._fleet.no_room_reason(ask.reserve)
            return self._remember(decision)
        locations = self._index.longest_prefix(request.block_keys)
        own = summarize_hits(locations)
        ctx = self._context(ask, own, decode_views)
        placement = self._place(ctx, ask.tbt_slo_s)
        self._judge(decision, placement, ask)
        if decision.rejected:
            return self._remember(decision)
        queue = None if placement.bypass else self._fleet.prefill[placement.prefill_instance]
        hold = hold_placement(placement, queue, ask)
        decision.replications += self._copies(ctx, placement, locations, own)
        return self._remember(decision, hold)

    def on_event(self, event: Event) -> bool | None:
        """What happened to a placed request (router/events.py). `Finished` and `Abandoned`
        answer whether the request still held anything here (False: released already)."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a Conductor event: {event!r}; see router/events.py")
        return handler(event)

    def observe(self, report: Report) -> None:
        """What an instance reports (router/reports.py): its load, its tiers' block events, or
        a measured timing for the online refit of the cost model."""
        if isinstance(report, BlockEvents):
            for event in report.events:
                self._index.apply(event)
        elif isinstance(report, PrefillLoad | DecodeLoad):
            self._fleet.observe(report)
        else:
            self._estimates.observe(report)

    def add_instance(
        self,
        instance: Hashable,
        role: str,
        *,
        node: str | None = None,
        tensor_parallel_size: int | None = None,
        capacity_tokens: int | None = None,
    ) -> Registered:
        """Register `instance` as a `role` ("prefill", "decode" or "both") instance, afresh on
        each side it takes: a prefill side loads prefixes without a fetch from `node`'s store
        (None: its own blocks only, as in the simulator); a decode side has `capacity_tokens`
        of KV (None: the profile's); each side runs at `tensor_parallel_size` (None: the
        profile's degree of that side). Returns the views the router keeps of it."""
        check_choice("instance role", role, ROLES)
        tp, fleet = tensor_parallel_size, self._fleet
        prefill = fleet.add_prefill(instance, node, tp) if role != "decode" else None
        decode = fleet.add_decode(instance, capacity_tokens, tp) if role != "prefill" else None
        return Registered(prefill, decode)

    def remove_instance(self, instance: Hashable) -> None:
        """Forget an instance that died or left, and every block the index held for it."""
        self._fleet.remove(instance)
        self._index.drop_instance(instance)

    def explain(self, request_id: str) -> str:
        """The candidates, their predictions and why one won, for a recent request."""
        return self._placed.explain(request_id)

    def snapshot(self) -> dict:
        """The settings, the profile as it stands and the TTFT prediction error, as plain data."""
        return {
            "policy": self._config.policy,
            "router": dataclasses.asdict(self._config),
            "profile": profile_to_dict(self._estimates.profile),
            "ttft_prediction_error": dataclasses.asdict(self._view.prediction_error()),
        }

    def view(self) -> ConductorView:
        """Read-only questions: the profile as it stands, decisions, loads, the index."""
        return self._view

    def _prefill_done(self, event: PrefillDone) -> None:
        # The work queued behind it on its instance is still to do, from `now`.
        hold = self._placed.hold_of(event.request_id)
        if hold is not None and self._fleet.counted(hold):
            hold.queue.finish(hold.job, event.now)
            hold.queue = None

    def _decode_joined(self, event: DecodeJoined) -> None:
        hold = self._placed.hold_of(event.request_id)
        if hold is not None:
            hold.decode.join(hold.admitted, event.now)

    def _first_token(self, event: FirstToken) -> None:
        placed = self._placed.holding(event.request_id)
        predicted_s = None if placed is None else placed.decision.predicted_ttft_s
        self._estimates.first_token(event, predicted_s)

    def _finished(self, event: Finished) -> bool:
        released = self._release(event.request_id, event.now)
        if released:
            self._estimates.finished(event.output_tokens)
        return released

    def _abandoned(self, event: Abandoned) -> bool:
        # Its worker died and it is routed again: released without counting it.
        return self._release(event.request_id, event.now)

    def _release(self, request_id: str, now: float) -> bool:
        """Give back the request's decode reservation and unfinished prefill work."""
        placed = self._placed.release(request_id)
        if placed is None:
            return False
        hold = placed.hold
        hold.decode.leave(hold.admitted, hold.reserve_tokens)
        if self._fleet.counted(hold):
            hold.queue.drop(hold.job, now)
        return True

    def _replicated(self, event: Replicated) -> None:
        if self._replicator is not None:
            self._replicator.on_replicated(event.copy)

    def _context(
        self, ask: RouteAsk, own: PrefixHits, decode_views: list[DecodeView]
    ) -> PlacementContext:
        """What a policy sees: a node's store counts as local to its workers (copies still go
        to a worker's own pages); colocated, only instances with room and their own cache."""
        hits = self._fleet.near(own)
        prefill_views = list(self._fleet.prefill.values())
        if self._colocated:
            prefill_views = [self._fleet.prefill[v.instance] for v in decode_views]
            hits = PrefixHits(hits.local_blocks, None, None)
        predictor, tokens = self._estimates.predictor, ask.decode_tokens
        tbt = tbt_predictor(predictor, self._config.admission, ask.now, tokens)
        return PlacementContext(
            ask.request, ask.now, hits, prefill_views, decode_views, predictor, tokens, tbt
        )

    def _place(self, ctx: PlacementContext, tbt_slo_s: float | None) -> Placement:
        """The policy's placement (with the short-prompt bypass where it wins); colocated,
        the request decodes where it prefills."""
        if not self._colocated:
            return place_with_bypass(self._policy, self._config, ctx, tbt_slo_s)
        placement = self._policy.place(ctx)
        placement.decode = self._fleet.decode[placement.prefill_instance]
        placement.tbt_s = ctx.tbt(placement.decode, ctx.now + placement.ttft_s)
        return placement

    def _judge(self, decision: Decision, placement: Placement, ask: RouteAsk) -> None:
        """Fill `decision` in from `placement` (the profile's overheads on top), rejected when
        it breaks router.max_ttft_s, scaled as recent predictions fell short, or the admission
        mode's SLOs."""
        profile, prefill = self._estimates.profile, self._fleet.prefill
        handoff_s = 0.0 if placement.bypass else profile.handoff_s
        fill_decision(decision, placement, profile.request_overhead_s + handoff_s, prefill)
        errors, predictor = self._estimates.errors, self._estimates.predictor
        bound = TtftBound.of(self._config.max_ttft_s, errors, prefill, ask.now)
        mode, predicted_s = self._config.admission, decision.predicted_ttft_s
        decision.reason = ask.rejection(mode, placement, predictor, predicted_s, bound)
        decision.rejected = bool(decision.reason)

    def _copies(
        self,
        ctx: PlacementContext,
        placement: Placement,
        locations: dict[Location, int],
        own: PrefixHits,
    ) -> list[Replication]:
        """The hot-prefix copy planned beside a placement (`own`: the blocks each instance
        holds itself, not counting its node's store), if any."""
        if self._replicator is None:
            return []
        prefill = self._fleet.prefill
        copy = plan_replication(self._replicator, ctx, placement, locations, own, prefill)
        return [] if copy is None else [copy]

    def _remember(self, decision: Decision, hold: Hold | None = None) -> Decision:
        self._placed.remember(decision, hold)
        return decision
