"""Colocated instances, the capacity bisection and `halfmoon bench capacity`."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
from router_testkit import simple_profile

from halfmoon.bench.studies.capacity import main
from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.errors import RouterConfigError
from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import DEFAULT_PROFILE, save_profile
from halfmoon.router.sim.capacity import MAX_SCALE, highest_passing
from halfmoon.router.sim.colocated_instance import ColocatedJob, SimColocated
from halfmoon.router.sim.colocated_simulation import ColocatedSimulation
from halfmoon.router.sim.splits import Split, parse_split
from halfmoon.router.sim.trace import TraceRecord

COST = CostModel((0.005, 1e-4, 0.0, 0.0), (0.004, 1e-3, 1e-6))
PROFILE = dataclasses.replace(simple_profile(), cost=COST)


def instance(max_batched_tokens: int = 64) -> SimColocated:
    return SimColocated("c0", PROFILE, 100, PrefixIndex(), 10, max_batched_tokens)


def job(rid: str, prompt: int, output: int, first_key: int = 0) -> ColocatedJob:
    keys = list(range(first_key, first_key + (prompt + 9) // 10))
    return ColocatedJob(rid, keys, prompt, output, predicted_s=0.0)


def decode_tbt(with_prompt: bool) -> float:
    """TBT of a 3-token request whose decode shares its steps with a 126-token prompt or not."""
    engine = instance()
    engine.add(job("a", 10, 3))
    engine.advance(1e-9)  # one pure prefill step; "a" then joins the batch with 11 tokens
    assert engine.batch.clock_s == pytest.approx(COST.prefill_step_time([(10, 0)]))
    start = engine.batch.clock_s
    if with_prompt:
        engine.add(job("b", 126, 1, first_key=100))
        engine.advance(start + 1e-9)
        first = COST.step_time([(63, 0)], 1, 11)
        assert engine.batch.clock_s - start == pytest.approx(first)
        assert first > COST.decode_step_time(1, 11)
    engine.drain()
    (finished,) = [f for f in engine.finished if f.request_id == "a"]
    return finished.tbt_s


def test_a_prefill_chunk_lengthens_the_decode_step_it_shares():
    alone = decode_tbt(with_prompt=False)
    shared = decode_tbt(with_prompt=True)
    assert alone == pytest.approx((COST.decode_step_time(1, 11) + COST.decode_step_time(1, 12)) / 2)
    mixed = COST.step_time([(63, 0)], 1, 11) + COST.step_time([(63, 63)], 1, 12)
    assert shared == pytest.approx(mixed / 2)


def test_a_local_prefix_hit_prefills_only_the_rest():
    engine = instance(max_batched_tokens=1000)
    engine.add(job("a", 100, 1))
    engine.drain()
    start = engine.batch.clock_s
    engine.add(job("b", 120, 1))  # shares the 10 blocks of "a"
    engine.drain()
    first = {f.request_id: f for f in engine.first_tokens}
    assert first["b"].cached_tokens == 100
    assert first["b"].time_s - start == pytest.approx(COST.prefill_step_time([(20, 100)]))
    assert first["b"].time_s - start < COST.prefill_time(120)


def record(arrival_s: float, prompt: int, output: int, first_key: int) -> TraceRecord:
    keys = list(range(first_key, first_key + (prompt + 9) // 10))
    return TraceRecord(0, arrival_s, prompt, output, keys)


def test_cache_aware_routing_follows_the_prefix_and_least_loaded_spreads():
    # c0 is still decoding the first request when the third, which shares its prefix, arrives.
    records = [record(0.0, 200, 50, 0), record(0.1, 200, 2, 1000), record(0.2, 210, 2, 0)]

    def hits(policy: str) -> float:
        config = RouterConfig(policy=policy, block_size=10)
        return ColocatedSimulation(config, PROFILE, 2, 100).run(records, progress=False).hit_rate

    assert hits("cache_aware_local") == pytest.approx(20 / 61)
    assert hits("least_loaded") == 0.0
    with pytest.raises(RouterConfigError, match="colocated routing"):
        ColocatedSimulation(RouterConfig(policy="conductor"), PROFILE, 2, 100)


@pytest.mark.parametrize("start", [0.01, 1.0, 50.0])
def test_bisection_finds_a_known_threshold(start):
    calls = []

    def passes(x: float) -> bool:
        calls.append(x)
        return x <= 3.7

    found = highest_passing(passes, start, 0.01)
    assert 3.7 / 1.01 <= found <= 3.7
    assert len(calls) < 25
    known = {x: x <= 3.7 for x in calls}
    calls.clear()
    assert highest_passing(passes, start, 0.01, known) == found
    assert calls == []  # every answer it needs is already known


def test_bisection_stops_at_its_bounds():
    assert highest_passing(lambda x: False, 1.0, 0.05) == 0.0
    assert highest_passing(lambda x: True, 1.0, 0.05) == MAX_SCALE


def write_trace(path, num_requests: int = 120, seed: int = 0) -> None:
    """Sessions that reuse their earlier blocks, Poisson arrivals of mean gap 0.2 s."""
    rng = random.Random(seed)
    clock_ms, lines, next_id = 0.0, [], 1000
    sessions = [[s] for s in range(4)]
    for _ in range(num_requests):
        clock_ms += rng.expovariate(1 / 200)
        session = rng.choice(sessions)
        session.extend(range(next_id, next_id + 3))
        next_id += 3
        ids = session[-12:]
        line = {
            "timestamp": int(clock_ms),
            "input_length": 10 * len(ids),
            "output_length": rng.randint(2, 30),
            "hash_ids": ids,
        }
        lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines))


@pytest.fixture
def capacity_args(tmp_path):
    trace, profile = tmp_path / "trace.jsonl", tmp_path / "profile.yaml"
    write_trace(trace)
    save_profile(PROFILE, profile)
    return [
        "--trace",
        str(trace),
        "--profile",
        str(profile),
        "--splits",
        "2+1,1+2",
        "--block-size",
        "10",
        "--tolerance",
        "0.1",
        "--ttft-slo",
        "0.2",
        "--no-progress",
    ]


def test_small_sweep_end_to_end_writes_json_and_plot(tmp_path, capsys, capacity_args):
    out, png = tmp_path / "capacity.json", tmp_path / "capacity.png"
    assert main([*capacity_args, "--json", str(out), "--plot", str(png), "--at-rates", "3"]) == 0
    table = capsys.readouterr().out
    assert "| 100 ms |" in table and "ratio" in table
    result = json.loads(out.read_text())
    assert [c["tbt_slo_ms"] for c in result["capacity"]] == [100, 200, 300]
    modes = ["disaggregated/2P@tp1+1D@tp1", "disaggregated/1P@tp1+2D@tp1"]
    modes += ["colocated/least_loaded", "colocated/cache_aware_local"]
    assert list(result["runs"]) == modes
    for cap in result["capacity"]:
        assert cap["disaggregated"]["rps"] == max(cap["rps"][m] for m in modes[:2])
        assert cap["colocated"]["rps"] == max(cap["rps"][m] for m in modes[2:])
        assert cap["ratio"] == pytest.approx(cap["disaggregated"]["rps"] / cap["colocated"]["rps"])
    for runs in result["runs"].values():
        assert any(r["rate_rps"] == pytest.approx(3.0) for r in runs)
        for run in runs:
            assert set(run["attainment"]) == {"100", "200", "300"}
    for mode in modes:  # the capacity passes the target; a run 10 % (tolerance) above fails
        for cap in result["capacity"]:
            rps, key = cap["rps"][mode], f"{cap['tbt_slo_ms']:g}"
            at = {round(r["rate_rps"], 9): r["attainment"][key] for r in result["runs"][mode]}
            if rps > 0:
                assert at[round(rps, 9)] >= 0.9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_without_a_file_prints_one_object(capsys, capacity_args):
    assert main([*capacity_args, "--tbt-slos", "0.2", "--colocated-routing", "least_loaded"]) == 0
    capsys.readouterr()
    assert main([*capacity_args, "--tbt-slos", "0.2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [c["tbt_slo_ms"] for c in result["capacity"]] == [200]


@pytest.mark.parametrize(
    ("text", "split"),
    [
        ("2@4+4@2", Split(2, 4, 4, 2)),
        ("13+3", Split(13, 8, 3, 8)),
        ("1@16+3", Split(1, 16, 3, 8)),
        ("13P@tp8+3D@tp4", Split(13, 8, 3, 4)),
    ],
)
def test_a_split_names_each_side_s_degree_or_takes_the_profile_s(text, split):
    assert parse_split(text, 8) == split
    assert parse_split(split.name, 1) == split


@pytest.mark.parametrize(
    ("splits", "message"),
    [
        ("2+1,2+2", r"same GPUs N x P \+ M x D \(2P@tp1\+1D@tp1 = 3, 2P@tp1\+2D@tp1 = 4\)"),
        ("2@2+1,1+2", "same GPUs"),
        ("2@2+1@0", "every degree must be >= 1"),
        ("2@x+2", "write N\\+M or N@P\\+M@D pairs"),
        ("4", "write N\\+M or N@P\\+M@D pairs"),
    ],
)
def test_bad_splits_are_an_error(capsys, capacity_args, splits, message):
    assert main([*capacity_args, "--splits", splits]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_a_colocated_degree_must_divide_the_gpus(capsys, capacity_args):
    assert main([*capacity_args, "--splits", "2@2+1@2", "--colocated-degree", "4"]) == 2
    err = capsys.readouterr().err
    assert "--colocated-degree 4: the splits' 6 GPUs are not a whole number" in err


def test_a_degree_whose_gpus_cannot_hold_the_weights_is_an_error_naming_it(capsys, capacity_args):
    args = [*capacity_args, "--profile", str(DEFAULT_PROFILE)]
    assert main([*args, "--splits", "1@1+1@8", "--colocated-degree", "1"]) == 2
    err = capsys.readouterr().err
    assert "split 1P@tp1+1D@tp8: profile llama70b-8xa800 at prefill degree 1:" in err
    assert main([*args, "--splits", "1@4+1@4", "--colocated-degree", "1"]) == 2
    err = capsys.readouterr().err
    assert "--colocated-degree 1: profile llama70b-8xa800 at prefill degree 1:" in err


def test_a_sweep_across_degrees_names_each_and_times_it_by_the_profile_at_it(
    tmp_path, capsys, capacity_args
):
    out = tmp_path / "capacity.json"
    splits = ["--splits", "2+2,1@2+2", "--colocated-degree", "2", "--tbt-slos", "0.2"]
    routing = ["--colocated-routing", "least_loaded"]
    assert main([*capacity_args, *splits, *routing, "--json", str(out)]) == 0
    assert "| colocated 2 x TP2 req/s (best routing) |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["gpus"] == 4
    assert [s["profile"] for s in result["splits"]] == ["test", "test@tp2/1"]
    assert result["colocated"]["instances"] == 2
    assert result["colocated"]["profile"] == "test@tp2"
    assert list(result["runs"]) == [
        "disaggregated/2P@tp1+2D@tp1",
        "disaggregated/1P@tp2+2D@tp1",
        "colocated/least_loaded",
    ]
    (cap,) = result["capacity"]
    assert all(rps > 0 for rps in cap["rps"].values())


def test_halfmoon_bench_capacity_help(capsys):
    from halfmoon.cluster.cli import main as halfmoon

    with pytest.raises(SystemExit) as exit_info:
        halfmoon(["bench", "capacity", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    phrases = ("bisection", "--splits", "N@P+M@D", "--colocated-degree", "--json", "--plot")
    for phrase in phrases:
        assert phrase in text
