"""The Conductor: the global router that places each request on a prefill and a decode instance."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from halfmoon.kvstore.index import PrefixIndex
from halfmoon.router.admission import admission_reason
from halfmoon.router.bypass import bypass_placement
from halfmoon.router.config import RouterConfig, check_slo
from halfmoon.router.cost_model import step_sample
from halfmoon.router.decision import Decision
from halfmoon.router.errors import InvalidRequestError, RouterConfigError
from halfmoon.router.online_fit import OnlineRefit
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.policies import make_policy
from halfmoon.router.prediction_error import PredictionErrorLog, PredictionErrorStats
from halfmoon.router.predictor import Predictor, summarize_hits
from halfmoon.router.profile import Profile
from halfmoon.router.replication import Replication, Replicator
from halfmoon.router.request import RouteRequest
from halfmoon.router.views import Admitted, DecodeView, PrefillView

HANDOFF_WINDOW = 256  # recent disaggregated requests whose hand-off time `handoff_s` averages


@dataclasses.dataclass(slots=True)
class _InFlight:
    decision: Decision
    num_prompt_tokens: int
    reserve_tokens: int
    expected_output_tokens: int


class Conductor:
    """Routes requests by predicted TTFT and TBT; fed by instance reports and block events."""

    def __init__(
        self, config: RouterConfig, profile: Profile, index: PrefixIndex | None = None
    ) -> None:
        self.config = config
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
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._inflight: dict[str, _InFlight] = {}
        self._output_tokens_sum = 0
        self._output_tokens_count = 0
        self._handoffs: deque[float] = deque(maxlen=HANDOFF_WINDOW)
        self._handoff_sum = 0.0
        self.replicator: Replicator | None = None
        if config.replicate:
            self.replicator = Replicator(
                config.block_size,
                config.replicate_min_hits,
                config.replicate_max_copies,
                config.replicate_margin_s,
                config.replicate_cooldown_s,
                config.replicate_window_requests,
            )

    def add_prefill(self, instance: Hashable) -> PrefillView:
        """Register a prefill instance."""
        view = self.prefill[instance] = PrefillView(instance)
        return view

    def add_decode(self, instance: Hashable, capacity_tokens: int | None = None) -> DecodeView:
        """Register a decode instance with `capacity_tokens` of KV (default: the profile's)."""
        capacity = capacity_tokens or self.profile.decode_kv_capacity_tokens
        view = self.decode[instance] = DecodeView(instance, capacity)
        return view

    def remove_instance(self, instance: Hashable) -> None:
        """Forget an instance that died or left, and every block the index held for it."""
        self.prefill.pop(instance, None)
        self.decode.pop(instance, None)
        self.index.drop_instance(instance)

    @property
    def mean_output_tokens(self) -> int:
        """Mean output length of finished requests (the configured default before any)."""
        if self._output_tokens_count == 0:
            return self.config.default_output_tokens
        return max(self._output_tokens_sum // self._output_tokens_count, 1)

    def route(self, request: RouteRequest, now: float) -> Decision:
        """Place `request` arriving at `now`, or reject it with the predicted figure and SLO."""
        ttft_slo_s = self._slo("ttft_slo_s", request.ttft_slo_s, self.config.ttft_slo_s)
        tbt_slo_s = self._slo("tbt_slo_s", request.tbt_slo_s, self.config.tbt_slo_s)
        expected_output = request.expected_output_tokens or self.mean_output_tokens
        decode_tokens = request.num_prompt_tokens + expected_output // 2
        reserve = request.num_prompt_tokens + request.max_output_tokens
        decision = Decision(request.request_id, self.policy.name)
        decode_views = [v for v in self.decode.values() if v.free_kv_tokens >= reserve]
        if not self.prefill or not decode_views:
            decision.rejected = True
            decision.reason = self._no_room_reason(reserve)
            return self._remember(decision)
        locations = self.index.longest_prefix(request.block_keys)
        ctx = PlacementContext(
            request,
            now,
            summarize_hits(locations),
            list(self.prefill.values()),
            decode_views,
            self.predictor,
            decode_tokens,
            self._tbt_predictor(now, decode_tokens),
        )
        placement = self.policy.place(ctx)
        if self.policy.name == "conductor" and self.config.bypass_max_tokens > 0:
            stall_s = tbt_slo_s if tbt_slo_s is not None else self.config.bypass_max_stall_s
            placement = (
                bypass_placement(ctx, placement, self.config.bypass_max_tokens, stall_s)
                or placement
            )
        self._fill(decision, placement)
        decision.reason = admission_reason(
            self.config.admission, placement, self.predictor, decode_tokens, ttft_slo_s,
            tbt_slo_s, decision.predicted_ttft_s - placement.ttft_s,
        )  # fmt: skip
        decision.rejected = bool(decision.reason)
        if not decision.rejected:
            self._commit(decision, request, now, placement, decode_tokens, reserve, expected_output)
            if self.replicator is not None:
                self._plan_replication(decision, request, ctx, placement, locations)
        return self._remember(decision)

    def on_replicated(self, replication: Replication) -> None:
        """A copy planned by `route` landed (or failed); the index learns of it from events."""
        if self.replicator is not None:
            self.replicator.on_replicated(replication)

    def explain(self, request_id: str) -> str:
        """The candidates, their predictions and why one won, for a recent request."""
        decision = self._decisions.get(request_id)
        if decision is None:
            raise KeyError(
                f"no decision for request {request_id!r}; only the last "
                f"{self.config.explain_capacity} are kept (RouterConfig.explain_capacity)"
            )
        return decision.explain()

    def decision(self, request_id: str) -> Decision | None:
        """The remembered decision for `request_id`, if still kept."""
        return self._decisions.get(request_id)

    def on_prefill_start(self, request_id: str, now: float) -> None:
        """The prefill instance began the request's prefill."""
        inflight = self._inflight.get(request_id)
        if inflight is not None and not inflight.decision.bypass:
            view = self.prefill.get(inflight.decision.prefill_instance)
            if view is not None:
                view.start(request_id, now)

    def on_prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished (its first token is out)."""
        inflight = self._inflight.get(request_id)
        if inflight is None:
            return
        decision = inflight.decision
        view = self.prefill.get(decision.prefill_instance)
        if view is not None and not decision.bypass:
            view.finish(now)

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

    def observe_step(self, step) -> None:
        """A worker's `engine.llm_engine.StepTiming`: pure prefill and pure decode steps
        refine the cost model; mixed steps (a bypassed prefill beside decodes) are skipped."""
        sample = step_sample(step)
        if sample is None:
            return
        kind, shape, step_s = sample
        if kind == "prefill":
            self.observe_prefill_step(shape, step_s)
        else:
            self.observe_decode_step(*shape, step_s)

    def set_request_overhead(self, seconds: float) -> None:
        """A calibrated per-request overhead (idle pipeline); the hand-off estimate restarts."""
        self.profile.request_overhead_s = max(seconds, 0.0)
        self.profile.handoff_s = 0.0
        self._handoffs.clear()
        self._handoff_sum = 0.0

    def observe_handoff(self, seconds: float) -> None:
        """A disaggregated request's TTFT minus its prefill compute and the base overhead:
        the profile's `handoff_s` follows the mean of the recent ones."""
        window, seconds = self._handoffs, max(seconds, 0.0)
        if len(window) == window.maxlen:
            self._handoff_sum -= window[0]
        window.append(seconds)
        self._handoff_sum += seconds
        self.profile.handoff_s = max(self._handoff_sum / len(window), 0.0)

    def observe_ttft(self, request_id: str, actual_s: float) -> None:
        """The measured TTFT of a routed request, recorded next to its prediction."""
        inflight = self._inflight.get(request_id)
        if inflight is not None:
            self.errors.record(inflight.decision.predicted_ttft_s, actual_s)

    def on_decode_join(self, request_id: str, now: float) -> None:
        """The request's KV landed and it joined the decode batch."""
        inflight = self._inflight.get(request_id)
        if inflight is None:
            return
        view = self.decode.get(inflight.decision.decode_instance)
        if view is not None:
            view.join(request_id, now)

    def report_decode(self, instance: Hashable, batch_size: int, kv_tokens: int) -> None:
        """A decode worker's report of its running batch."""
        self.decode[instance].report(batch_size, kv_tokens)

    def report_prefill(
        self, instance: Hashable, queued_ids: list[str], running_remaining_s: float, now: float
    ) -> None:
        """A prefill worker's report of its queue and the time left on its running prefill."""
        self.prefill[instance].apply_report(queued_ids, running_remaining_s, now)

    def on_finish(self, request_id: str, now: float, output_tokens: int) -> None:
        """The request finished, was cancelled or hit its deadline: release its reservation."""
        if self.on_abandon(request_id):
            self._output_tokens_sum += output_tokens
            self._output_tokens_count += 1

    def on_abandon(self, request_id: str) -> bool:
        """Release the request's reservation and queue slot without counting it (its worker
        died and it is routed again); False if it held none."""
        inflight = self._inflight.pop(request_id, None)
        if inflight is None:
            return False
        decision = inflight.decision
        view = self.decode.get(decision.decode_instance)
        if view is not None:
            view.leave(request_id, inflight.reserve_tokens)
        queue = self.prefill.get(decision.prefill_instance)
        if queue is not None and not decision.bypass:
            queue.drop(request_id)
        return True

    def prediction_error(self) -> PredictionErrorStats:
        """How far predicted TTFT was from the observed TTFT."""
        return self.errors.stats()

    def _tbt_predictor(self, now: float, decode_tokens: int):
        predictor = self.predictor
        if self.config.admission == "prediction_early_rejection":
            return lambda view, when_s: predictor.tbt_at(view, now, when_s, decode_tokens)
        return lambda view, when_s: predictor.tbt_with_pending(view, decode_tokens)

    def _fill(self, decision: Decision, placement: Placement) -> None:
        plan = placement.plan
        decision.prefill_instance = placement.prefill_instance
        decision.decode_instance = placement.decode.instance
        overhead_s = self.profile.request_overhead_s
        if not placement.bypass:
            overhead_s += self.profile.handoff_s
        decision.predicted_ttft_s = placement.ttft_s + overhead_s
        decision.predicted_queue_s = placement.queue_s
        decision.predicted_tbt_s = placement.tbt_s
        decision.cached_tokens = plan.cached_tokens
        decision.local_cached_tokens = plan.local_cached_tokens
        decision.fetch_from = plan.fetch_from
        decision.fetch_tokens = plan.fetch_tokens
        decision.bypass = placement.bypass
        decision.candidates = placement.candidates

    def _commit(
        self,
        decision: Decision,
        request: RouteRequest,
        now: float,
        placement: Placement,
        decode_tokens: int,
        reserve: int,
        expected_output: int,
    ) -> None:
        rid = request.request_id
        if placement.bypass:
            placement.decode.bypass_until_s = now + placement.ttft_s
        else:
            new_tokens = request.num_prompt_tokens - placement.plan.cached_tokens
            self.prefill[placement.prefill_instance].enqueue(rid, placement.plan.work_s, new_tokens)
        entry = Admitted(decode_tokens, now + placement.ttft_s, expected_output)
        placement.decode.admit(rid, entry, reserve)
        self._inflight[rid] = _InFlight(
            decision, request.num_prompt_tokens, reserve, expected_output
        )

    def _plan_replication(
        self,
        decision: Decision,
        request: RouteRequest,
        ctx: PlacementContext,
        placement: Placement,
        locations: dict,
    ) -> None:
        assert self.replicator is not None
        served_by = None if placement.bypass else placement.prefill_instance
        fetched = placement.plan.fetch_from is not None and not placement.bypass
        copy = self.replicator.plan(
            request.block_keys, locations, ctx.hits, self.prefill, served_by, fetched, ctx.now
        )
        if copy is not None:
            decision.replications.append(copy)

    def _remember(self, decision: Decision) -> Decision:
        if self.config.explain_capacity > 0:
            self._decisions[decision.request_id] = decision
            self._decisions.move_to_end(decision.request_id)
            while len(self._decisions) > self.config.explain_capacity:
                self._decisions.popitem(last=False)
        return decision

    def _no_room_reason(self, reserve: int) -> str:
        if not self.prefill:
            return "no prefill instance is registered; add one with add_prefill()"
        most = max((v.free_kv_tokens for v in self.decode.values()), default=0)
        return (
            f"no decode instance has {reserve} tokens of KV free (most free: {most}); "
            "retry later or add decode instances"
        )

    @staticmethod
    def _slo(name: str, override: float | None, default: float | None) -> float | None:
        if override is None:
            return default
        try:
            check_slo(name, override)
        except RouterConfigError as exc:
            raise InvalidRequestError(str(exc)) from exc
        return override
