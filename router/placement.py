"""What a policy sees when it places one request, and what it answers."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from halfmoon.router.decision import Candidate
from halfmoon.router.predictor import Predictor, PrefillPlan, PrefixHits
from halfmoon.router.request import RouteRequest
from halfmoon.router.views import DecodeView, PrefillView


@dataclass(slots=True)
class PlacementContext:
    """One request, the cluster as the router sees it now, and the predictors to score it."""

    request: RouteRequest
    now: float
    hits: PrefixHits
    prefill: list[PrefillView]
    decode: list[DecodeView]
    predictor: Predictor
    decode_tokens: int
    tbt: Callable[[DecodeView, float], float]


@dataclass(slots=True)
class Placement:
    """A policy's choice: prefill instance and plan, decode instance, and what it predicted."""

    prefill_instance: Hashable
    queue_s: float
    plan: PrefillPlan
    decode: DecodeView
    tbt_s: float
    candidates: list[Candidate]
    bypass: bool = False

    @property
    def ttft_s(self) -> float:
        """Predicted time to first token: queue plus prefill work (plus any fetch)."""
        return self.queue_s + self.plan.work_s
