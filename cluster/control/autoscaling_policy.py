"""Autoscaling policy schemas, one per pool: signal tracking (`target`) or SLO planning."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

# Tags mark which policy kind a validation error came from; the error formatter drops them.
TAG_PREFIX = "kind="
POLICY_KINDS = ("target", "slo_planner")


class AutoscalingError(ValueError):
    """An autoscaling policy cannot be applied: a signal is missing or a target is unreachable."""


def invalid(field: str, reason: str) -> PydanticCustomError:
    """A cross-field error reported at `field` (a dotted path below the validating section)."""
    return PydanticCustomError("cross_field", "{reason}", {"field": field, "reason": reason})


class BasePolicy(BaseModel):
    """Bounds and pacing shared by every policy kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(300.0, ge=0)
    cooldown_s: float = Field(60.0, ge=0)
    max_step: int = Field(1, ge=1)

    @property
    def needs_cost_model(self) -> bool:
        """Whether the policy plans from the workers' cost model (no throughput given here)."""
        return False

    @model_validator(mode="after")
    def _bounds_ordered(self) -> BasePolicy:
        if self.max_replicas < self.min_replicas:
            raise invalid(
                "max_replicas",
                f"{self.max_replicas} is below min_replicas = {self.min_replicas}; "
                "raise max_replicas or lower min_replicas",
            )
        return self


class TargetPolicy(BasePolicy):
    """Keep the pool's per-replica signal near `target` (proportional, like Kubernetes' HPA)."""

    kind: Literal["target"] = "target"
    target: float = Field(gt=0)


class PrefillTargetPolicy(TargetPolicy):
    """Prefill signals: predicted queue seconds or waiting prompt tokens, per replica."""

    signal: Literal["queue_s", "waiting_tokens"] = "queue_s"


class DecodeTargetPolicy(TargetPolicy):
    """Decode signals: KV pages used ratio, running requests or predicted TBT, per replica."""

    signal: Literal["pages_used_ratio", "running_requests", "predicted_tbt_s"] = "pages_used_ratio"

    @model_validator(mode="after")
    def _ratio_below_one(self) -> DecodeTargetPolicy:
        if self.signal == "pages_used_ratio" and self.target > 1:
            raise invalid("target", f"{self.target} is a pages_used_ratio: a fraction in (0, 1]")
        return self


class PlannerPolicy(BasePolicy):
    """Replicas from request rate, prompt and output lengths and profiled throughput."""

    kind: Literal["slo_planner"] = "slo_planner"
    # Extra capacity over the computed need, so a burst does not break the SLO at once.
    headroom: float = Field(1.2, ge=1)
    # Seconds of traffic the controller averages the rate and lengths over.
    window_s: float = Field(60.0, gt=0)


class PrefillPlannerPolicy(PlannerPolicy):
    """Prefill replicas that keep TTFT (queue + prefill) under `ttft_s`."""

    # None: the cluster's slo.ttft_s.
    ttft_s: float | None = Field(None, gt=0)
    # Prompt tokens/s one replica prefills; None: from the router's live cost model each round.
    prefill_tokens_per_s: float | None = Field(None, gt=0)

    @property
    def needs_cost_model(self) -> bool:
        return self.prefill_tokens_per_s is None


class DecodePlannerPolicy(PlannerPolicy):
    """Decode replicas whose generated tokens/s at the TBT target cover the load."""

    # None: the cluster's slo.tbt_s.
    tbt_s: float | None = Field(None, gt=0)
    # Tokens/s one replica generates with its step time at tbt_s; None: from the live cost model.
    decode_tokens_per_s: float | None = Field(None, gt=0)

    @property
    def needs_cost_model(self) -> bool:
        return self.decode_tokens_per_s is None


def _kind_tag(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return f"{TAG_PREFIX}{kind}" if kind in POLICY_KINDS else None


def _tagged(target: type, planner: type) -> Any:
    return Annotated[
        Annotated[target, Tag(f"{TAG_PREFIX}target")]
        | Annotated[planner, Tag(f"{TAG_PREFIX}slo_planner")],
        Discriminator(
            _kind_tag,
            custom_error_type="policy_kind",
            custom_error_message="must be 'target' or 'slo_planner'",
        ),
    ]


PrefillPolicy = _tagged(PrefillTargetPolicy, PrefillPlannerPolicy)
DecodePolicy = _tagged(DecodeTargetPolicy, DecodePlannerPolicy)
Policy = PrefillTargetPolicy | DecodeTargetPolicy | PrefillPlannerPolicy | DecodePlannerPolicy


class AutoscalingConfig(BaseModel):
    """One policy per pool; a pool without one keeps its configured replicas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: PrefillPolicy | None = None
    decode: DecodePolicy | None = None
