"""What one request asks of the cluster when it is routed, and SLO admission: accept
everything, or reject at arrival when a prediction breaks the SLO."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.router.config import RouterConfig, check_slo
from halfmoon.router.errors import InvalidRequestError, RouterConfigError
from halfmoon.router.placement import Placement
from halfmoon.router.predictor import Predictor
from halfmoon.router.request import RouteRequest
from halfmoon.router.ttft_bound import TtftBound


@dataclass(slots=True)
class RouteAsk:
    """One request routed at `now`: its SLOs (its own or the configured ones), its expected
    output, the KV it brings to decode on average, and the KV reserved for it."""

    request: RouteRequest
    now: float
    ttft_slo_s: float | None
    tbt_slo_s: float | None
    expected_output: int
    decode_tokens: int
    reserve: int

    @classmethod
    def of(
        cls, request: RouteRequest, now: float, config: RouterConfig, mean_output: int
    ) -> RouteAsk:
        expected = request.expected_output_tokens or mean_output
        return cls(
            request,
            now,
            ttft_slo_s=_slo("ttft_slo_s", request.ttft_slo_s, config.ttft_slo_s),
            tbt_slo_s=_slo("tbt_slo_s", request.tbt_slo_s, config.tbt_slo_s),
            expected_output=expected,
            decode_tokens=request.num_prompt_tokens + expected // 2,
            reserve=request.num_prompt_tokens + request.max_output_tokens,
        )

    def rejection(
        self,
        mode: str,
        placement: Placement,
        predictor: Predictor,
        predicted_ttft_s: float,
        bound: TtftBound,
    ) -> str:
        """Why the request placed as `placement`, predicted a TTFT of `predicted_ttft_s`, must
        be rejected at arrival, or "": the router's TTFT bound, then admission `mode`'s SLOs."""
        overhead_s = predicted_ttft_s - placement.ttft_s
        reason = bound.reason(placement, predicted_ttft_s)
        return reason or admission_reason(mode, self, placement, predictor, overhead_s)


def admission_reason(
    mode: str, ask: RouteAsk, placement: Placement, predictor: Predictor, overhead_s: float = 0.0
) -> str:
    """Why `placement` of `ask` must be rejected under `mode`, or "" to admit it.

    `early_rejection` judges TBT by the decode batch as last reported (Mooncake's early
    rejection); `prediction_early_rejection` by the batch predicted for when prefill ends.
    `overhead_s` is what the request pays beyond queue and prefill (the profile's overheads).
    """
    if mode == "none":
        return ""
    ttft_s = placement.ttft_s + overhead_s
    if ask.ttft_slo_s is not None and ttft_s > ask.ttft_slo_s:
        return (
            f"predicted TTFT {ttft_s:.3f}s on {placement.prefill_instance} exceeds "
            f"the TTFT SLO {ask.ttft_slo_s:.3f}s"
        )
    if ask.tbt_slo_s is None:
        return ""
    if mode == "early_rejection":
        tbt_s = predictor.tbt_now(placement.decode, ask.decode_tokens)
    else:
        tbt_s = placement.tbt_s
    if tbt_s > ask.tbt_slo_s:
        return (
            f"predicted TBT {tbt_s:.4f}s on {placement.decode.instance} exceeds "
            f"the TBT SLO {ask.tbt_slo_s:.4f}s"
        )
    return ""


def _slo(name: str, override: float | None, default: float | None) -> float | None:
    if override is None:
        return default
    try:
        check_slo(name, override)
    except RouterConfigError as exc:
        raise InvalidRequestError(str(exc)) from exc
    return override
