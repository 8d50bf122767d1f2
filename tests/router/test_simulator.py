import json
import random

import pytest
from router_testkit import simple_profile

from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.errors import TraceFormatError
from halfmoon.router.sim.decode_instance import SimDecode
from halfmoon.router.sim.simulate import main
from halfmoon.router.sim.simulation import SimInstances, Simulation
from halfmoon.router.sim.trace import TraceRecord, read_trace, unbounded_hit_rate


def write_trace(path, num_requests: int = 300, seed: int = 0) -> None:
    """Conversations that share system prompts and earlier turns, Poisson arrivals."""
    rng = random.Random(seed)
    lines, clock_ms, next_id = [], 0.0, 1000
    sessions = [[s] for s in range(5)]
    for _ in range(num_requests):
        clock_ms += rng.expovariate(1 / 400)
        session = rng.choice(sessions)
        turn = [next_id + i for i in range(rng.randint(1, 6))]
        next_id += len(turn)
        session.extend(turn)
        ids = list(session)
        tokens = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append(
            json.dumps(
                {
                    "timestamp": int(clock_ms),
                    "input_length": tokens,
                    "output_length": rng.randint(1, 300),
                    "hash_ids": ids,
                }
            )
        )
        if len(session) > 40:
            del session[1:]
    path.write_text("\n".join(lines) + "\n")


def run(capsys, *args) -> dict:
    assert main([*args, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path)
    return path


BASE = ("--prefill", "3", "--decode", "2", "--cache-blocks-per-instance", "60")


def test_simulation_is_deterministic_for_a_seed(capsys, trace):
    first = run(capsys, "--trace", str(trace), *BASE, "--policy", "random", "--seed", "3")
    second = run(capsys, "--trace", str(trace), *BASE, "--policy", "random", "--seed", "3")
    other = run(capsys, "--trace", str(trace), *BASE, "--policy", "random", "--seed", "4")
    first.pop("wall_s"), second.pop("wall_s"), other.pop("wall_s")
    assert first == second
    assert first != other


def test_json_report_has_the_promised_fields(capsys, trace):
    result = run(capsys, "--trace", str(trace), *BASE, "--policy", "conductor")
    for key in ("ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s", "slo_attainment"):
        assert result[key] >= 0
    assert result["requests"] == 300
    assert result["rejected"] == 0
    assert 0 < result["hit_rate"] <= result["hit_rate_unbounded"]
    assert result["wall_s"] > 0


def test_cache_aware_beats_random_on_a_shared_prefix_trace(capsys, trace):
    fast = run(capsys, "--trace", str(trace), *BASE, "--policy", "conductor", "--time-scale", "4")
    slow = run(capsys, "--trace", str(trace), *BASE, "--policy", "random", "--time-scale", "4")
    assert fast["ttft_mean_s"] < slow["ttft_mean_s"]
    assert fast["hit_rate"] > slow["hit_rate"]


def test_early_rejection_rejects_against_the_slo(capsys, trace):
    args = ("--trace", str(trace), *BASE, "--policy", "conductor", "--time-scale", "8")
    result = run(capsys, *args, "--admission", "early_rejection", "--ttft-slo", "1.0")
    assert result["rejected"] > 0
    assert result["ttft_p99_s"] <= 1.0 + 1e-9


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    path.write_text(f'{good}\nnot json\n{{"timestamp": 5, "input_length": -3}}\n{good}\n')
    result = run(capsys, "--trace", str(path), *BASE, "--policy", "least_loaded")
    err = capsys.readouterr().err
    assert result["requests"] == 2
    assert result["bad_lines"] == 2
    records, bad = read_trace(path)
    assert [e.line_number for e in bad] == [2, 3]
    assert "bad.jsonl:3: input_length -3 must be an integer >= 1" in str(bad[1])
    del err


def test_malformed_line_is_fatal_on_request(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [1]}\n[]\n'
    )
    status = main(["--trace", str(path), *BASE, "--policy", "conductor", "--on-bad-line", "fail"])
    assert status == 2
    assert "bad.jsonl:2: expected a JSON object" in capsys.readouterr().err
    with pytest.raises(TraceFormatError):
        read_trace(path, on_bad_line="fail")


def test_unknown_policy_and_impossible_slo_exit_with_a_config_error(trace, capsys):
    assert main(["--trace", str(trace), *BASE, "--policy", "nearest"]) == 2
    assert "unknown routing policy 'nearest'" in capsys.readouterr().err
    assert main(["--trace", str(trace), *BASE, "--policy", "conductor", "--ttft-slo", "0"]) == 2
    assert "ttft_slo_s = 0.0 can never be met" in capsys.readouterr().err


def test_unbounded_hit_rate_counts_blocks_seen_before(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, num_requests=50)
    records, _ = read_trace(path)
    seen, hits = set(), 0
    for record in records:
        hits += sum(1 for h in record.hash_ids if h in seen)
        seen.update(record.hash_ids)
    assert unbounded_hit_rate(records) == hits / sum(len(r.hash_ids) for r in records)


@pytest.mark.parametrize("coef", [(0.0, 0.0, 0.0), (-0.01, 0.0, 0.0), (0.001, 0.0, -1e-3)])
def test_a_fit_that_prices_decode_steps_at_zero_or_less_still_advances_time(coef):
    decode = SimDecode("d0", CostModel((0, 0, 0, 0), coef))
    decode.join("a", 100, 5)
    when = decode.next_finish_s()
    assert when is not None and when > 0
    assert [f.request_id for f in decode.advance(when)] == ["a"]


def test_decode_closed_form_matches_stepping_one_token_at_a_time():
    cost = CostModel((0, 0, 0, 0), (0.01, 1e-3, 1e-6))
    decode = SimDecode("d0", cost)
    decode.join("a", 1000, 7)
    decode.join("b", 500, 3)
    finished = decode.advance(10.0)
    # Step by step: both run 3 steps, then "a" alone runs 4 more.
    clock, kv, times = 0.0, 1500, {}
    for step in range(7):
        batch = 2 if step < 3 else 1
        clock += 0.01 + 1e-3 * batch + 1e-6 * kv
        kv += batch
        if step == 2:
            times["b"] = clock
            kv -= 503
    times["a"] = clock
    assert {f.request_id: f.finish_s for f in finished} == pytest.approx(times)
    assert decode.batch_size == 0 and decode.kv_tokens == 0


def test_hand_off_is_the_last_layer_transfer_so_predictions_can_miss():
    lengths = (100, 400, 200)  # one layer of 100 tokens moves in 10 ms at 1 MB/s
    records = [
        TraceRecord(0, 10.0 * i, n, 2, list(range(1000 * i, 1000 * i + n // 10)))
        for i, n in enumerate(lengths)
    ]
    config = RouterConfig(block_size=10, bypass_max_tokens=0)
    sim = Simulation(config, SimInstances(simple_profile(1e6), 1, 1, 99))
    summary = sim.run(records, progress=False)
    ttft, _ = sim.latencies()
    assert list(ttft) == pytest.approx([n * 1e-3 + n * 1e-4 for n in lengths])
    # The Conductor predicts the mean hand-off seen so far: 0, then 10 ms, then 25 ms.
    view = sim.conductor.view()
    predicted = [view.decision(str(i)).predicted_ttft_s for i in range(3)]
    assert predicted == pytest.approx([0.1, 0.41, 0.225])
    assert summary.ttft_pred_error_mean_s == pytest.approx((0.01 + 0.03 + 0.005) / 3)
