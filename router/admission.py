"""SLO admission: accept everything, or reject at arrival when a prediction breaks the SLO."""

from __future__ import annotations

from halfmoon.router.placement import Placement
from halfmoon.router.predictor import Predictor


def admission_reason(
    mode: str,
    placement: Placement,
    predictor: Predictor,
    decode_tokens: int,
    ttft_slo_s: float | None,
    tbt_slo_s: float | None,
    overhead_s: float = 0.0,
) -> str:
    """Why `placement` must be rejected under `mode`, or "" to admit it.

    `early_rejection` judges TBT by the decode batch as last reported (Mooncake's early
    rejection); `prediction_early_rejection` by the batch predicted for when prefill ends.
    `overhead_s` is what the request pays beyond queue and prefill (the profile's overheads).
    """
    if mode == "none":
        return ""
    ttft_s = placement.ttft_s + overhead_s
    if ttft_slo_s is not None and ttft_s > ttft_slo_s:
        return (
            f"predicted TTFT {ttft_s:.3f}s on {placement.prefill_instance} exceeds "
            f"the TTFT SLO {ttft_slo_s:.3f}s"
        )
    if tbt_slo_s is None:
        return ""
    if mode == "early_rejection":
        tbt_s = predictor.tbt_now(placement.decode, decode_tokens)
    else:
        tbt_s = placement.tbt_s
    if tbt_s > tbt_slo_s:
        return (
            f"predicted TBT {tbt_s:.4f}s on {placement.decode.instance} exceeds "
            f"the TBT SLO {tbt_slo_s:.4f}s"
        )
    return ""
