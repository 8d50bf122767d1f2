"""`halfmoon bench serve --across-nodes` (bench/serve_nodes.py): a tiny run in a process of its
own (a pytest process holds one Ray instance only, and the bench makes Ray nodes of its own)
serves the same requests with prefill and decode on two Ray nodes and on one, and reports both
layouts' TTFT and TPOT, the ratio and the path the KV took."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scenario_kit import SCENARIO_ENV

from halfmoon.bench import serve_nodes

TINY = [
    "--num-prompts",
    "3",
    "--request-rate",
    "4",
    "--random-input-len",
    "48",
    "--random-output-len",
    "6",
    # The shipped CPU profile instead of one measured (and calibrated) at each cluster's start.
    "--router-profile",
    "cpu-tiny",
    "--disable-tqdm",
    "--json",
]
FIGURES = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def test_the_goal_is_judged_on_ttft_p50_split_over_one_node():
    one = {"p50_ttft_ms": 100.0, "p50_tpot_ms": 5.0}
    verdict = serve_nodes.judge({"split": {"p50_ttft_ms": 120.0}, "one_node": one})
    assert verdict["goal"] == {"ttft_p50_ratio": 1.2, "bound": "<= 1.3", "met": True}
    assert (
        serve_nodes.judge({"split": {"p50_ttft_ms": 140.0}, "one_node": one})["goal"]["met"]
        is False
    )


def test_counters_are_what_grew_over_the_run():
    before = {"decode-1": {"num_engine_receives": 2}}
    after = {"decode-1": {"num_engine_receives": 5, "num_streamed_layers": 0}}
    assert serve_nodes.grown(before, after) == {
        "decode-1": {"num_engine_receives": 3, "num_streamed_layers": 0}
    }


def decode_counters(layout: dict) -> dict:
    (decode,) = [counts for name, counts in layout["counters"].items() if "decode" in name]
    return decode


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_run_reports_both_layouts_and_the_engine_between_the_nodes(tiny_model_dir):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine cannot be imported")
    command = [sys.executable, "-m", "halfmoon.cluster.cli", "bench", "serve", "--across-nodes"]
    result = subprocess.run(
        [*command, "--model", str(tiny_model_dir), *TINY],
        env={**os.environ, **SCENARIO_ENV},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    layouts = report["layouts"]
    assert set(layouts) == {"split", "one_node"}
    for figures in layouts.values():
        assert figures["completed"] == 3 and figures["failed"] == 0
        assert all(figures[key] > 0 for key in FIGURES)
    split, one = layouts["split"], layouts["one_node"]
    assert set(split["kv_transfer"].values()) == {"mooncake tcp"}
    assert len(set(split["nodes"].values())) == 2 and len(set(one["nodes"].values())) == 1
    assert decode_counters(split)["num_engine_receives"] == 3
    assert decode_counters(split)["num_streamed_layers"] == 0
    assert decode_counters(one)["num_engine_receives"] == 0  # the one-node path
    ratio = report["ratio_split_over_one_node"]["p50_ttft_ms"]
    assert report["goal"]["ttft_p50_ratio"] == pytest.approx(ratio)
    assert isinstance(report["goal"]["met"], bool)
