"""The cache-limit bound of a trace and the share of the possible gain a policy reached."""

from __future__ import annotations

import dataclasses
import json

import pytest
from router_testkit import simple_profile

from halfmoon.router.profile import save_profile
from halfmoon.router.sim.cache_bound import cache_bound_ttft_s, gain_share, seen_prefix_blocks
from halfmoon.router.sim.simulate import main
from halfmoon.router.sim.trace import TraceRecord

# (arrival ms, prompt tokens, hash ids) over 10-token blocks. At 1 ms a token, unqueued and
# with every prefix seen earlier cached: 30 + 1000 + 5 + 1 + 30 ms (the prompt of 20 tokens
# still computes its last token; [7, 2, 3] shares blocks, not a leading one).
TRACE = [
    (0, 30, [1, 2, 3]),
    (10_000, 1000, list(range(50, 150))),
    (10_100, 25, [1, 2, 9]),
    (20_000, 20, [1, 2]),
    (30_000, 30, [7, 2, 3]),
]
BOUND_S = (0.030 + 1.0 + 0.005 + 0.001 + 0.030) / 5


def records() -> list[TraceRecord]:
    return [TraceRecord(i, ms / 1000, n, 2, ids) for i, (ms, n, ids) in enumerate(TRACE)]


def test_seen_prefix_counts_leading_blocks_an_earlier_request_held():
    assert seen_prefix_blocks(records()) == [0, 0, 2, 2, 0]


def test_bound_is_the_overhead_plus_the_prefill_of_what_was_never_seen():
    profile = dataclasses.replace(simple_profile(), request_overhead_s=0.01)
    assert cache_bound_ttft_s(records(), profile, 10) == pytest.approx(BOUND_S + 0.01)
    assert cache_bound_ttft_s([], profile, 10) == 0.0


def test_gain_share_is_one_at_the_bound_and_zero_at_the_baseline():
    assert gain_share(4.0, 2.0, 1.0) == pytest.approx(2 / 3)
    assert gain_share(4.0, 1.0, 1.0) == 1.0
    assert gain_share(4.0, 4.0, 1.0) == 0.0
    assert gain_share(4.0, 5.0, 1.0) == pytest.approx(-1 / 3)
    assert gain_share(1.0, 1.0, 1.0) is None


@pytest.fixture
def simulate_args(tmp_path) -> list[str]:
    """`halfmoon simulate` on TRACE over 2 prefill + 1 decode instances, 1 ms a token."""
    save_profile(simple_profile(), tmp_path / "profile.yaml")
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": ms, "input_length": n, "output_length": 2, "hash_ids": ids}
        for ms, n, ids in TRACE
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return [
        "--trace",
        str(trace),
        "--prefill",
        "2",
        "--decode",
        "1",
        "--block-size",
        "10",
        "--profile",
        str(tmp_path / "profile.yaml"),
        "--no-progress",
    ]


def test_simulate_reports_the_bound_and_the_share_of_the_possible_gain(simulate_args, capsys):
    assert main([*simulate_args, "--policy", "conductor", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ttft_bound_mean_s"] == pytest.approx(BOUND_S)
    # least_loaded sends [1, 2, 9] to the idle instance, without its prefix: 20 ms more.
    assert result["least_loaded_ttft_mean_s"] == pytest.approx(BOUND_S + 0.004, abs=1e-6)
    # The conductor fetches that prefix: the bound but for each request's hand-off (ns).
    assert result["gain_share"] == pytest.approx(1.0, abs=1e-3)
    assert main([*simulate_args, "--policy", "conductor", "--no-baseline", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["least_loaded_ttft_mean_s"], result["gain_share"]) == (None, None)


def test_simulate_prints_the_bound_line(simulate_args, capsys):
    assert main([*simulate_args, "--policy", "conductor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "cache-limit bound: mean TTFT 0.213s (every prefix seen earlier cached, no queueing); "
        "least_loaded 0.217s: conductor reached 100% of the possible gain"
    ) in lines
    assert main([*simulate_args, "--policy", "conductor", "--no-baseline"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = "cache-limit bound: mean TTFT 0.213s (every prefix seen earlier cached, no queueing)"
    assert expected in lines
