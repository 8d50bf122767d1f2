"""Baseline policies that ignore the cache: random, round robin and least loaded."""

from __future__ import annotations

import random

from halfmoon.router.decision import Candidate
from halfmoon.router.placement import Placement, PlacementContext
from halfmoon.router.views import DecodeView, PrefillView


def place_on(ctx: PlacementContext, view: PrefillView, decode: DecodeView, note: str) -> Placement:
    """Place on `view` using only its local cache, and `decode`."""
    hits, name = ctx.hits, view.instance
    plan = ctx.predictor.local_plan(
        hits.local_blocks.get(name, 0), ctx.request.num_prompt_tokens, hits.near_blocks.get(name, 0)
    )
    queue_s = view.delay_s(ctx.now, plan.work_s)
    tbt_s = ctx.tbt(decode, ctx.now + queue_s + plan.work_s)
    candidates = [
        Candidate(view.instance, "prefill", queue_s + plan.work_s, note),
        Candidate(decode.instance, "decode", tbt_s, note),
    ]
    return Placement(view.instance, queue_s, plan, decode, tbt_s, candidates)


def decode_load(view: DecodeView) -> int:
    """Sequences running or on their way to `view`."""
    return view.batch_size + view.num_pending


class RandomPolicy:
    """Uniformly random prefill and decode instances (seeded)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def place(self, ctx: PlacementContext) -> Placement:
        """Pick both instances at random."""
        view = ctx.prefill[self._rng.randrange(len(ctx.prefill))]
        decode = ctx.decode[self._rng.randrange(len(ctx.decode))]
        return place_on(ctx, view, decode, "random pick")


class RoundRobinPolicy:
    """Prefill and decode instances in turn."""

    name = "round_robin"

    def __init__(self, seed: int) -> None:
        self._next_prefill = 0
        self._next_decode = 0

    def place(self, ctx: PlacementContext) -> Placement:
        """Take the next instance of each kind."""
        view = ctx.prefill[self._next_prefill % len(ctx.prefill)]
        decode = ctx.decode[self._next_decode % len(ctx.decode)]
        self._next_prefill += 1
        self._next_decode += 1
        return place_on(ctx, view, decode, "next in turn")


class LeastLoadedPolicy:
    """The prefill instance with the fewest predicted seconds queued; the lightest decode batch."""

    name = "least_loaded"

    def __init__(self, seed: int) -> None:
        pass

    def place(self, ctx: PlacementContext) -> Placement:
        """Pick the least queued prefill instance and least loaded decode instance."""
        now = ctx.now
        view = min(ctx.prefill, key=lambda v: v.wait_s(now))
        decode = min(ctx.decode, key=decode_load)
        return place_on(ctx, view, decode, "least queued work")
