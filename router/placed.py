"""The Conductor's one book of the requests it placed: each decision (the last few, for
`explain`) and, while a request is in flight, what it holds on its instances."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.router.decision import Decision
from halfmoon.router.views import Admitted, DecodeView, PrefillJob, PrefillView

if TYPE_CHECKING:
    from halfmoon.router.admission import RouteAsk
    from halfmoon.router.placement import Placement


@dataclass(slots=True)
class Hold:
    """What a placed request holds until it ends: decode KV (`admitted` on `decode`) and,
    until its prefill finishes, its `job` in `queue` (the prefill view it was counted in)."""

    reserve_tokens: int
    decode: DecodeView
    admitted: Admitted
    queue: PrefillView | None = None
    job: PrefillJob | None = None


def hold_placement(placement: Placement, queue: PrefillView | None, ask: RouteAsk) -> Hold:
    """Commit a placement on its instances: the decode KV reserved and, unless the prompt
    bypasses prefill, its uncached work counted in `queue` (its prefill instance's view)."""
    now = ask.now
    admitted = Admitted(ask.decode_tokens, now + placement.ttft_s, ask.expected_output)
    hold = Hold(ask.reserve, placement.decode, admitted)
    if queue is None:
        placement.decode.bypass_until_s = now + placement.ttft_s
    else:
        hold.queue = queue
        num_new_tokens = ask.request.num_prompt_tokens - placement.plan.cached_tokens
        hold.job = queue.enqueue(placement.plan.work_s, num_new_tokens, now, placement.ttft_s)
    placement.decode.admit(admitted, ask.reserve)
    return hold


@dataclass(slots=True)
class Placed:
    decision: Decision
    hold: Hold | None = None
    explainable: bool = True


class PlacedRequests:
    """Decisions in the order they were made; the last `capacity` can be explained, and a
    request's entry stays while it holds anything."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_id: OrderedDict[str, Placed] = OrderedDict()
        self._num_explainable = 0

    def remember(self, decision: Decision, hold: Hold | None) -> None:
        """Record a decision; a rejected re-route leaves an earlier hold in place."""
        old = self._by_id.pop(decision.request_id, None)
        if old is not None:
            self._num_explainable -= old.explainable
            hold = hold or old.hold
        explainable = self.capacity > 0
        if explainable or hold is not None:
            self._by_id[decision.request_id] = Placed(decision, hold, explainable)
            self._num_explainable += explainable
            self._trim()

    def decision(self, request_id: str) -> Decision | None:
        """The decision for `request_id` if it is among the last `capacity`."""
        entry = self._by_id.get(request_id)
        return entry.decision if entry is not None and entry.explainable else None

    def explain(self, request_id: str) -> str:
        """`Decision.explain` of a request among the last `capacity`; KeyError otherwise."""
        decision = self.decision(request_id)
        if decision is None:
            raise KeyError(
                f"no decision for request {request_id!r}; only the last {self.capacity} are "
                "kept (RouterConfig.explain_capacity)"
            )
        return decision.explain()

    def hold_of(self, request_id: str) -> Hold | None:
        """What the request still holds, or None."""
        entry = self._by_id.get(request_id)
        return None if entry is None else entry.hold

    def holding(self, request_id: str) -> Placed | None:
        """The entry of a request that still holds something, else None."""
        entry = self._by_id.get(request_id)
        return entry if entry is not None and entry.hold is not None else None

    def release(self, request_id: str) -> Placed | None:
        """Take the request's hold away (returned with its decision); None if it held none."""
        entry = self.holding(request_id)
        if entry is None:
            return None
        released = Placed(entry.decision, entry.hold)
        entry.hold = None
        if not entry.explainable:
            del self._by_id[request_id]
        return released

    def _trim(self) -> None:
        # An entry past `capacity` that still holds something moves to the back unexplainable.
        while self._num_explainable > self.capacity:
            request_id, entry = next(iter(self._by_id.items()))
            if entry.explainable:
                entry.explainable = False
                self._num_explainable -= 1
            if entry.hold is None:
                self._by_id.popitem(last=False)
            else:
                self._by_id.move_to_end(request_id)
