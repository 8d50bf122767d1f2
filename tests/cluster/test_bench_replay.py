"""`halfmoon bench replay` end to end: a short trace on a live 1+1 cluster and the
step-level simulator on the same scaled trace, with the figures the simulator reports and,
per request, the router's predicted TTFT against the measured one, live and simulated."""

from __future__ import annotations

import json
import math

import pytest

from halfmoon.bench.studies import replay as bench_replay

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


@pytest.mark.timeout(300)
def test_replay_reports_live_and_simulated_figures_side_by_side(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "timestamp": 150 * i,
            "input_length": 900 + 300 * (i % 3),
            "output_length": 96,
            "hash_ids": [0, 1 + i % 2, 10 + i],
        }
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows_path = tmp_path / "rows.jsonl"
    args = ["--trace", str(trace), "--requests", "12", "--ttft-slo", "5", "--tbt-slo", "1"]
    more = ["--bypass-tokens", "0", "--json", "--rows", str(rows_path)]  # all through prefill
    assert bench_replay.main([*args, *more]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scale"]["token_scale"] == 16 / 512
    for run in bench_replay.SIDES:
        figures = result[run]
        assert figures["requests"] == 12 and figures["rejected"] == 0
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert figures["tbt_mean_s"] > 0 and 0 <= figures["slo_attainment"] <= 1
        assert figures["throughput_rps"] > 0
    assert math.isfinite(result["sim_over_live_ttft_mean"])
    profiles = result["profiles"]
    assert profiles["steps_observed"] > 0 and profiles["handoff_s"] >= 0
    assert profiles["observed_live"]["prefill"]["chunk_tokens"] == 64
    check_predictions(result["predictions"])
    check_request_rows(result["request_rows"])
    assert [json.loads(line) for line in rows_path.read_text().splitlines()] == json.loads(
        json.dumps(result["request_rows"])
    )


def check_predictions(predictions: dict) -> None:
    """Every side predicted every request, with finite errors and sane cache figures."""
    for run in bench_replay.SIDES:
        side = predictions[run]
        assert side["requests"] == side["predicted"] == 12
        assert 0 <= side["error_p50"] <= side["error_p90"] < math.inf
        assert math.isfinite(side["bias_p50"]) and side["bypassed"] == 0
        assert side["cached_tokens"] > 0 and 0 <= side["fetches"] <= 12
        assert side["fetched_tokens"] >= 0
    assert 0 < predictions["cached_live_over_sim"] < math.inf  # all share two leading blocks
    assert 0 <= predictions["simulated"]["queued"] <= 12


def check_request_rows(rows: list[dict]) -> None:
    """One row per request, in trace order, each side's TTFT and prediction positive."""
    assert [row["request_id"] for row in rows] == bench_replay.request_ids(12)
    for row in rows:
        for run in bench_replay.SIDES:
            side = row[run]
            assert side["outcome"] == "finished" and side["prefill_instance"] is not None
            assert side["predicted_ttft_s"] > 0 and side["ttft_s"] > 0
            assert 0 <= side["num_cached_tokens"] < row["num_prompt_tokens"]
