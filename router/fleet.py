"""The Conductor's instances: a view of each prefill queue and decode batch by name, kept up to
date from the instances' load reports."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from halfmoon.router.degree import instance_degree
from halfmoon.router.placed import Hold
from halfmoon.router.predictor import Predictor, PrefixHits
from halfmoon.router.profile import Profile
from halfmoon.router.reports import DecodeLoad, PrefillLoad
from halfmoon.router.views import DecodeView, PrefillView

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class Registered:
    """The views an instance was registered with (None for a role it does not take)."""

    prefill: PrefillView | None
    decode: DecodeView | None


class Fleet:
    """Prefill and decode views by instance, and the prefill instances whose store node's host
    tier they load prefixes from without a fetch; timed by `profile` (the Conductor's own)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.prefill: dict[Hashable, PrefillView] = {}
        self.decode: dict[Hashable, DecodeView] = {}
        self._with_nodes: list[PrefillView] = []

    def add_prefill(self, instance: Hashable, node: str | None, degree: int | None) -> PrefillView:
        """A fresh view of prefill `instance` (replacing any), loading from `node`'s store."""
        self.remove_prefill(instance)
        shared = self.profile.cost.chunk_tokens > 0  # a chunking engine shares its steps
        degree = instance_degree(self.profile, "prefill", instance, degree)
        view = self.prefill[instance] = PrefillView(instance, node, shared, degree)
        if node is not None:
            self._with_nodes.append(view)
        return view

    def add_decode(
        self, instance: Hashable, capacity: int | None, degree: int | None
    ) -> DecodeView:
        """A fresh view of decode `instance` with `capacity` tokens of KV (None: the profile's)."""
        capacity = capacity or self.profile.decode_kv_capacity_tokens
        degree = instance_degree(self.profile, "decode", instance, degree)
        view = self.decode[instance] = DecodeView(instance, capacity, degree)
        return view

    def remove(self, instance: Hashable) -> None:
        """Forget both views of `instance`."""
        self.remove_prefill(instance)
        self.decode.pop(instance, None)

    def remove_prefill(self, instance: Hashable) -> None:
        view = self.prefill.pop(instance, None)
        if view is not None and view.node is not None:
            self._with_nodes.remove(view)

    def observe(self, report: PrefillLoad | DecodeLoad) -> None:
        """A worker's own load (ignored once it was removed): when a prefill worker holds every
        request sent to it (none on its way), its outstanding work is re-estimated from it."""
        if isinstance(report, DecodeLoad):
            if (view := self.decode.get(report.instance)) is not None:
                view.report(report.batch_size, report.kv_tokens)
        elif (view := self.prefill.get(report.instance)) is not None:
            left_s = self.profile.cost.prefill_time(report.tokens_left, 0)
            view.reconcile(report.num_requests, left_s, report.as_of)

    def decode_with_room(self, reserve: int) -> list[DecodeView]:
        """The decode views with `reserve` tokens of KV free."""
        return [view for view in self.decode.values() if view.free_kv_tokens >= reserve]

    def no_room_reason(self, reserve: int) -> str:
        """Why no request reserving `reserve` tokens of KV can be placed now."""
        if not self.prefill:
            return "no prefill instance is registered; add one with add_instance()"
        most = max((view.free_kv_tokens for view in self.decode.values()), default=0)
        return (
            f"no decode instance has {reserve} tokens of KV free (most free: {most}); "
            "retry later or add decode instances"
        )

    def counted(self, hold: Hold) -> bool:
        """Whether the hold's prefill work is still in a registered view's line (not in one
        since removed, or re-added afresh)."""
        queue = hold.queue
        return queue is not None and self.prefill.get(queue.instance) is queue

    def near(self, own: PrefixHits) -> PrefixHits:
        """Prefix hits with a node's store counted as local to its workers."""
        return own.with_nodes(self._with_nodes) if self._with_nodes else own

    def pool_load(self, now: float, predictor: Predictor) -> tuple[float, float]:
        """(summed predicted prefill queue seconds, worst predicted decode TBT now)."""
        queue_s = sum(view.wait_s(now) for view in self.prefill.values())
        tbt_s = max((predictor.tbt_now(v, 0) for v in self.decode.values()), default=0.0)
        return queue_s, tbt_s
