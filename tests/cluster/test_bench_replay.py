"""`halfmoon bench replay` end to end: a short trace on a live 1+1 cluster and the
step-level simulator on the same scaled trace, with the figures the simulator reports."""

from __future__ import annotations

import json
import math

import pytest

from halfmoon.cluster.bench import replay as bench_replay

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def test_replay_reports_live_and_simulated_figures_side_by_side(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "timestamp": 150 * i,
            "input_length": 900 + 300 * (i % 3),
            "output_length": 96,
            "hash_ids": [0, 1 + i % 2, 10 + i],
        }  # fmt: skip
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--trace", str(trace), "--requests", "12", "--ttft-slo", "5", "--tbt-slo", "1"]
    assert bench_replay.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scale"]["token_scale"] == 16 / 512
    for run in ("live", "simulated", "simulated_startup_profile"):
        figures = result[run]
        assert figures["requests"] == 12 and figures["rejected"] == 0
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
        assert figures["tbt_mean_s"] > 0 and 0 <= figures["slo_attainment"] <= 1
        assert figures["throughput_rps"] > 0
    assert math.isfinite(result["sim_over_live_ttft_mean"])
    profiles = result["profiles"]
    assert profiles["steps_observed"] > 0 and profiles["handoff_s"] >= 0
    assert profiles["observed_live"]["prefill"]["chunk_tokens"] == 64
