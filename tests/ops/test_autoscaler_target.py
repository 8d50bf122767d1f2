"""Target-tracking autoscaling on synthetic signals and a fake clock."""

from __future__ import annotations

import pytest

from halfmoon.cluster.control.autoscaling import Autoscaler
from halfmoon.cluster.control.autoscaling_policy import AutoscalingConfig, AutoscalingError


def prefill_scaler(**policy) -> Autoscaler:
    """A prefill autoscaler tracking queue_s = 1.0 with the given overrides."""
    base = {
        "kind": "target",
        "signal": "queue_s",
        "target": 1.0,
        "min_replicas": 1,
        "max_replicas": 4,
        "upscale_delay_s": 30,
        "downscale_delay_s": 60,
        "cooldown_s": 0,
        "max_step": 1,
    }
    return Autoscaler(AutoscalingConfig.model_validate({"prefill": base | policy}))


def feed(scaler: Autoscaler, start: float, stop: float, value: float, step: float = 10.0) -> None:
    """Observe queue_s = value every `step` seconds from start to stop inclusive."""
    now = start
    while now <= stop:
        scaler.observe("prefill", now, {"queue_s": value})
        now += step


# Up: 3 s is above the 1 s target. Down: 3 replicas at 0.2 s each would be 1 replica at 0.6 s,
# so the pool may shrink.
@pytest.mark.parametrize(
    ("value", "last_quiet_s", "replicas", "reason"),
    [(3.0, 20, 1, "scale up 1 -> 2: queue_s = 3 vs target 1"), (0.2, 50, 3, "scale down 3 -> 2")],
)
def test_scales_only_after_the_signal_stays_past_the_target_for_its_delay(
    value: float, last_quiet_s: float, replicas: int, reason: str
):
    scaler = prefill_scaler()
    feed(scaler, 0, last_quiet_s, value)
    assert scaler.decide("prefill", last_quiet_s, replicas).desired == replicas
    feed(scaler, last_quiet_s + 10, last_quiet_s + 10, value)
    decision = scaler.decide("prefill", last_quiet_s + 10, replicas)
    assert decision.desired == 2
    assert decision.reason.startswith(reason)


def test_a_dip_below_target_restarts_the_upscale_delay():
    scaler = prefill_scaler()
    feed(scaler, 0, 20, 3.0)
    feed(scaler, 30, 30, 0.9)
    feed(scaler, 40, 60, 3.0)
    assert scaler.decide("prefill", 60, 1).desired == 1
    feed(scaler, 70, 70, 3.0)
    assert scaler.decide("prefill", 70, 1).desired == 2


def test_does_not_scale_down_when_one_fewer_replica_would_exceed_the_target():
    scaler = prefill_scaler(downscale_delay_s=0)
    # 2 replicas at 0.6 s would be 1 at 1.2 s, above the target.
    scaler.observe("prefill", 0, {"queue_s": 0.6})
    assert scaler.decide("prefill", 0, 2).desired == 2


def test_cooldown_holds_the_pool_after_a_change():
    scaler = prefill_scaler(upscale_delay_s=0, cooldown_s=100)
    scaler.observe("prefill", 0, {"queue_s": 3.0})
    assert scaler.decide("prefill", 0, 1).desired == 2
    feed(scaler, 10, 90, 3.0)
    decision = scaler.decide("prefill", 90, 2)
    assert (decision.desired, decision.reason) == (2, "cooldown: 10.0s left")
    scaler.observe("prefill", 100, {"queue_s": 3.0})
    assert scaler.decide("prefill", 100, 2).desired == 3


def test_max_step_limits_one_change():
    scaler = prefill_scaler(upscale_delay_s=0, max_step=2, max_replicas=10)
    scaler.observe("prefill", 0, {"queue_s": 10.0})
    assert scaler.decide("prefill", 0, 1).desired == 3


def test_proportional_step_takes_the_smallest_need_over_the_delay():
    scaler = prefill_scaler(max_step=5, max_replicas=10)
    for now, value in ((0, 4.0), (10, 2.5), (20, 6.0), (30, 5.0)):
        scaler.observe("prefill", now, {"queue_s": value})
    assert scaler.decide("prefill", 30, 1).desired == 3


def test_bounds_win_over_the_signal():
    scaler = prefill_scaler(upscale_delay_s=0, downscale_delay_s=0, max_step=10)
    scaler.observe("prefill", 0, {"queue_s": 100.0})
    assert scaler.decide("prefill", 0, 1).desired == 4
    scaler = prefill_scaler(upscale_delay_s=0, downscale_delay_s=0, max_step=10)
    scaler.observe("prefill", 0, {"queue_s": 0.0})
    assert scaler.decide("prefill", 0, 3).desired == 1


def test_a_pool_at_its_bound_stays_and_says_why():
    scaler = prefill_scaler(upscale_delay_s=0, downscale_delay_s=0)
    scaler.observe("prefill", 0, {"queue_s": 9.0})
    decision = scaler.decide("prefill", 0, 4)
    assert (decision.desired, decision.reason) == (4, "at max_replicas = 4: would scale up")
    scaler.observe("prefill", 1, {"queue_s": 0.0})
    decision = scaler.decide("prefill", 1, 1)
    assert (decision.desired, decision.reason) == (1, "at min_replicas = 1: would scale down")


def test_a_pool_outside_its_bounds_is_brought_inside_at_once():
    scaler = prefill_scaler(min_replicas=2)
    assert scaler.decide("prefill", 0, 1).desired == 2
    assert scaler.decide("prefill", 0, 6).desired == 4


def test_a_steady_signal_keeps_the_pool():
    scaler = prefill_scaler()
    feed(scaler, 0, 600, 0.8)
    decision = scaler.decide("prefill", 600, 2)
    assert (decision.desired, decision.reason) == (2, "steady: no signal held past its delay")


def test_a_missing_signal_names_what_the_policy_reads():
    scaler = prefill_scaler()
    with pytest.raises(AutoscalingError, match=r"lack \['queue_s'\]"):
        scaler.observe("prefill", 0, {"waiting_tokens": 10})


def test_a_pool_without_policy_is_an_error():
    with pytest.raises(AutoscalingError, match="set autoscaling.decode"):
        prefill_scaler().observe("decode", 0, {"pages_used_ratio": 0.5})


def test_decode_pool_tracks_pages_used_ratio():
    config = AutoscalingConfig.model_validate(
        {"decode": {"kind": "target", "target": 0.5, "upscale_delay_s": 0}}
    )
    scaler = Autoscaler(config)
    scaler.observe("decode", 0, {"pages_used_ratio": 0.9})
    assert scaler.decide("decode", 0, 2).desired == 3
