"""`halfmoon bench ttft`'s report: stage medians, the ratio to the engine and the goal."""

from __future__ import annotations

import argparse

from halfmoon.bench.probes.ttft import (
    ModeResult,
    cluster_config,
    engine_prefill_times,
    make_prompts,
    print_report,
    report,
)


def test_the_report_orders_stage_medians_and_checks_the_goal_against_the_engine():
    result = ModeResult("disaggregated")
    result.ttft_s = [0.030, 0.020, 0.040]
    result.add_timeline([("tokenized", 0.001), ("first token out", 0.020)])
    result.add_timeline([("tokenized", 0.003), ("routed", 0.004), ("first token out", 0.030)])
    result.add_timeline([("tokenized", 0.002), ("tokenized", 0.009), ("first token out", 0.010)])
    args = argparse.Namespace(device="cpu", prompt_tokens=64, requests=3, request_rate=0.0)
    out = report([0.010, 0.012, 0.014], [result], args)
    mode = out["modes"]["disaggregated"]
    assert out["engine_prefill_p50_ms"] == 12.0
    assert round(out["goal_ttft_p50_ms"], 6) == 29.0  # 2 x 12 ms + 5 ms
    assert round(mode["ttft_p50_ms"], 6) == 30.0 and not mode["goal_met"]
    assert round(mode["ttft_over_engine"], 3) == 2.5
    assert list(mode["stages_p50_ms"]) == ["tokenized", "routed", "first token out"]
    assert round(mode["stages_p50_ms"]["tokenized"], 6) == 2.0  # a repeated mark: the first


def test_the_split_parts_queue_worker_and_engine_compute_and_hand_off(capsys):
    """Issue 51's split of served TTFT: until the prefill began, the prefill worker's compute
    against the engine's own forward passes within it, and the hand-off to the first token."""
    result = ModeResult("disaggregated")
    for began, ended, first in ((0.005, 0.045, 0.047), (0.007, 0.055, 0.060)):
        stages = ("prefill compute began", "prefill compute ended", "first token out")
        result.add_timeline(list(zip(stages, (began, ended, first), strict=True)))
    assert result.split_ms() is None  # no engine figure (colocated): no split
    result.engine_compute_s = 0.020
    result.ttft_s = [0.05, 0.06]
    split = result.split_ms()
    assert {k: round(v, 6) for k, v in split.items()} == {
        "queue": 6.0,
        "worker_compute": 44.0,
        "engine_compute": 20.0,
        "hand_off": 3.5,
    }
    args = argparse.Namespace(device="cpu", prompt_tokens=64, requests=2, request_rate=0.0)
    out = report([0.010, 0.012], [result], args)
    print_report(out)
    assert "prefill worker compute 44.00 ms (engine forward 20.00 ms, 2.20x)" in (
        capsys.readouterr().out
    )


def test_prompts_are_distinct_so_nothing_is_served_from_a_cache():
    prompts = make_prompts(8, 32, 256, seed=0)
    assert len({tuple(p[:16]) for p in prompts}) == 8
    assert all(len(p) == 32 and min(p) >= 6 for p in prompts)


def test_the_engine_baseline_times_each_prompt_in_process(tiny_model_dir):
    config = cluster_config(str(tiny_model_dir), "disaggregated", "cpu")
    times = engine_prefill_times(config, make_prompts(2, 40, 200, seed=1))
    assert len(times) == 2 and all(t > 0 for t in times)
