"""SLO planning: hand-computed replica counts, and the planner driving the autoscaler."""

from __future__ import annotations

import pytest

from halfmoon.cluster.control.autoscaling import Autoscaler
from halfmoon.cluster.control.autoscaling_planner import (
    Load,
    decode_tokens_per_s,
    plan_decode,
    plan_prefill,
    prefill_tokens_per_s,
)
from halfmoon.cluster.control.autoscaling_policy import AutoscalingConfig, AutoscalingError
from halfmoon.router.cost_model import CostModel

LOAD = Load(request_rate_per_s=20, mean_input_tokens=1000, mean_output_tokens=200)


def test_prefill_replicas_keep_ttft_under_target():
    # 20 req/s x 1000 tokens = 20,000 tokens/s; one prefill takes 1000 / 10,000 = 0.1 s; for
    # TTFT <= 0.5 s utilization must stay <= 1 - 0.1 / 0.5 = 0.8, so 20,000 / 8,000 = 2.5 -> 3.
    plan = plan_prefill(LOAD, tokens_per_s=10_000, ttft_s=0.5, headroom=1.0)
    assert plan.replicas == 3
    # With 1.2 headroom: 2.5 x 1.2 = 3.0 exactly, which float noise must not round up to 4.
    assert plan_prefill(LOAD, tokens_per_s=10_000, ttft_s=0.5, headroom=1.2).replicas == 3


def test_cached_prompt_tokens_are_not_planned_for():
    cached = Load(20, 1000, 200, mean_cached_tokens=600)
    # 20 x 400 = 8,000 tokens/s; 400 / 10,000 = 0.04 s; utilization <= 0.92; 8,000 / 9,200 -> 1.
    assert plan_prefill(cached, tokens_per_s=10_000, ttft_s=0.5, headroom=1.0).replicas == 1


def test_an_unreachable_ttft_plans_for_throughput_and_says_so():
    plan = plan_prefill(LOAD, tokens_per_s=10_000, ttft_s=0.05, headroom=1.0)
    assert plan.replicas == 2
    assert plan.reason.startswith("TTFT target 0.05s unreachable: one prefill takes 0.1s")


def test_decode_replicas_cover_output_tokens_at_the_tbt_target():
    # 20 req/s x 200 tokens = 4,000 tokens/s over 1,500 tokens/s per replica = 2.67 -> 3.
    assert plan_decode(LOAD, tokens_per_s=1_500, headroom=1.0).replicas == 3
    # x 1.2 = 3.2 -> 4.
    assert plan_decode(LOAD, tokens_per_s=1_500, headroom=1.2).replicas == 4


def test_no_load_needs_no_replicas():
    idle = Load(0, 1000, 200)
    assert plan_prefill(idle, 10_000, 0.5, 1.2).replicas == 0
    assert plan_decode(idle, 1_500, 1.2).replicas == 0


def test_throughput_from_a_cost_model():
    cost = CostModel(prefill_coef=(0.01, 1e-4, 0.0, 0.0), decode_coef=(0.01, 1e-3, 1e-6))
    # Prefill of 1000 tokens: 0.01 + 0.1 = 0.11 s -> 9,090.9 tokens/s.
    assert prefill_tokens_per_s(cost, LOAD) == pytest.approx(1000 / 0.11)
    # Context 1000 + 100 = 1100 tokens: per request 0.001 + 0.0011 = 0.0021 s per step; a 0.05 s
    # step fits floor(0.04 / 0.0021) = 19 requests, stepping in 0.01 + 19 x 0.0021 = 0.0499 s.
    assert decode_tokens_per_s(cost, 0.05, LOAD) == pytest.approx(19 / 0.0499)


def test_a_tbt_target_below_one_step_is_an_error():
    cost = CostModel(prefill_coef=(0.01, 1e-4, 0.0, 0.0), decode_coef=(0.05, 1e-3, 0.0))
    with pytest.raises(AutoscalingError, match="> TBT target 0.02s"):
        decode_tokens_per_s(cost, 0.02, LOAD)


def test_planner_policy_drives_both_pools():
    config = AutoscalingConfig.model_validate(
        {
            "prefill": {
                "kind": "slo_planner",
                "ttft_s": 0.5,
                "prefill_tokens_per_s": 10_000,
                "headroom": 1.0,
                "max_replicas": 8,
                "max_step": 4,
                "upscale_delay_s": 0,
            },
            "decode": {
                "kind": "slo_planner",
                "decode_tokens_per_s": 1_500,
                "headroom": 1.0,
                "max_replicas": 8,
                "max_step": 4,
                "upscale_delay_s": 0,
            },
        }
    )
    scaler = Autoscaler(config)
    signals = {"request_rate_per_s": 20, "mean_input_tokens": 1000, "mean_output_tokens": 200}
    for pool in ("prefill", "decode"):
        scaler.observe(pool, 0, signals)
    prefill = scaler.decide("prefill", 0, 1)
    assert prefill.desired == 3
    assert prefill.reason.startswith("scale up 1 -> 3: planner: 2e+04 prompt tokens/s")
    assert scaler.decide("decode", 0, 1).desired == 3


PLANNER = {"kind": "slo_planner", "headroom": 1.0, "upscale_delay_s": 0}
SIGNALS = {"request_rate_per_s": 20, "mean_input_tokens": 1000, "mean_output_tokens": 1}


def _cost(per_token_s: float) -> CostModel:
    return CostModel(prefill_coef=(0.0, per_token_s, 0.0, 0.0), decode_coef=(0.0, 1e-3, 0.0))


def test_planner_uses_the_cluster_slo_and_the_observed_cost_model_when_the_policy_omits_them():
    scaler = Autoscaler(AutoscalingConfig.model_validate({"prefill": PLANNER}), ttft_s=0.5)
    scaler.observe("prefill", 0, SIGNALS, _cost(1e-4))
    assert scaler.decide("prefill", 0, 1).desired == 2  # 3 needed, max_step 1


def test_each_observation_plans_from_the_cost_model_it_brings():
    # 20 req/s x 1000 tokens. At 1e-4 s/token a prefill takes 0.1 s: utilization <= 0.8 of
    # 10,000 tokens/s -> 2.5 -> 3 replicas. Refit to 5e-5 s/token: 0.05 s, <= 0.9 of 20,000
    # tokens/s -> 1.11 -> 2 replicas.
    policy = {**PLANNER, "max_replicas": 8, "max_step": 8, "cooldown_s": 0}
    scaler = Autoscaler(AutoscalingConfig.model_validate({"prefill": policy}), ttft_s=0.5)
    scaler.observe("prefill", 0, SIGNALS, _cost(1e-4))
    assert scaler.decide("prefill", 0, 1).desired == 3
    scaler.observe("prefill", 1, SIGNALS, _cost(5e-5))
    assert scaler.decide("prefill", 1, 1).desired == 2


@pytest.mark.parametrize(
    ("policies", "needed"),
    [
        ({"prefill": PLANNER}, True),
        ({"decode": {"kind": "slo_planner", "tbt_s": 0.05}}, True),
        ({"prefill": {**PLANNER, "prefill_tokens_per_s": 10_000}}, False),
        ({"decode": {"kind": "slo_planner", "decode_tokens_per_s": 1_500}}, False),
        ({"decode": {"kind": "target", "target": 0.8}}, False),
        ({}, False),
    ],
)
def test_only_planners_without_a_throughput_figure_need_the_cost_model(policies, needed):
    assert Autoscaler(AutoscalingConfig.model_validate(policies)).needs_cost_model is needed


def test_planner_without_throughput_or_cost_model_says_what_to_give():
    config = AutoscalingConfig.model_validate({"prefill": {"kind": "slo_planner", "ttft_s": 1}})
    with pytest.raises(AutoscalingError, match="pass cost= .* to observe"):
        Autoscaler(config).observe(
            "prefill",
            0,
            {"request_rate_per_s": 1, "mean_input_tokens": 10, "mean_output_tokens": 1},
        )


def test_a_cost_model_predicting_no_time_is_an_error_not_infinite_throughput():
    # A refit with a negative square term, extrapolated past the prompts it was fitted on.
    prefill = CostModel(prefill_coef=(0.03, 2e-4, -7e-6, 0.0), decode_coef=(0.0, 1e-3, 0.0))
    with pytest.raises(AutoscalingError, match="predicts 0s for a prefill of 1000 tokens"):
        prefill_tokens_per_s(prefill, LOAD)
    decode = CostModel(prefill_coef=(0.0, 1e-4, 0.0, 0.0), decode_coef=(0.001, -1e-3, 0.0))
    with pytest.raises(AutoscalingError, match="for each sequence of 1100 tokens in a decode"):
        decode_tokens_per_s(decode, 0.05, LOAD)


def test_an_idle_pool_plans_no_replicas_without_the_cost_model():
    policy = {**PLANNER, "max_replicas": 4, "downscale_delay_s": 0, "cooldown_s": 0}
    scaler = Autoscaler(AutoscalingConfig.model_validate({"prefill": policy}), ttft_s=0.5)
    idle = {"request_rate_per_s": 0, "mean_input_tokens": 0, "mean_output_tokens": 0}
    scaler.observe("prefill", 0, idle)
    decision = scaler.decide("prefill", 0, 3)
    assert decision.desired == 2
    assert decision.reason == (
        "scale down 3 -> 2: planner: no requests finished in the traffic window, held 0s"
    )
