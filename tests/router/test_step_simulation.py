"""The step-level simulation: engines stepped like LLMEngine, and whole runs on them."""

from __future__ import annotations

import dataclasses

import pytest
from router_testkit import simple_profile

from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.sim.simulation import SimInstances
from halfmoon.router.sim.step_engine import SimEngine, StepJob
from halfmoon.router.sim.step_simulation import StepSimulation
from halfmoon.router.sim.trace import TraceRecord

COST = CostModel((0.005, 1e-4, 0.0, 0.0), (0.004, 1e-3, 1e-6), chunk_tokens=64)


def run_until_idle(engine: SimEngine, now: float = 0.0):
    """Step the engine until it has nothing to do; yields each finished step's result."""
    while (plan := engine.start_step(now)) is not None:
        now = plan.end_s
        yield engine.finish_step()


def test_prompts_share_steps_in_chunks():
    engine = SimEngine("e", COST, max_batched_tokens=2048, max_num_seqs=64)
    engine.add_prefill(StepJob("a", 128, 0))
    engine.add_prefill(StepJob("b", 100, 0))
    results = list(run_until_idle(engine))
    assert [r.plan.chunks for r in results] == [[(64, 0), (64, 0)], [(64, 64), (36, 64)]]
    step_s = COST.prefill_step_time([(64, 0), (64, 0)])
    assert results[0].plan.seconds == pytest.approx(step_s)
    assert [j.request_id for j in results[1].prefilled] == ["a", "b"]


def test_token_budget_serves_the_oldest_prompt_first():
    engine = SimEngine("e", COST, max_batched_tokens=64, max_num_seqs=64)
    engine.add_prefill(StepJob("a", 128, 0))
    engine.add_prefill(StepJob("b", 64, 0))
    done = [[j.request_id for j in r.prefilled] for r in run_until_idle(engine)]
    assert done == [[], ["a"], ["b"]]


def test_a_prompt_waits_for_its_prefix_fetch():
    engine = SimEngine("e", COST, max_batched_tokens=2048, max_num_seqs=64)
    engine.add_prefill(StepJob("a", 32, 0, ready_s=1.0))
    assert engine.start_step(0.0) is None
    assert engine.next_ready_s() == 1.0
    assert engine.start_step(1.0).chunks == [(32, 0)]


def test_decoding_sequences_step_beside_a_prefill():
    engine = SimEngine("e", COST, max_batched_tokens=2048, max_num_seqs=64)
    engine.join("d", context_tokens=100, decode_steps=2, now=0.0)
    engine.add_prefill(StepJob("p", 32, 0, decode_steps=0))
    results = list(run_until_idle(engine))
    first = results[0].plan
    assert (first.chunks, first.decode_seqs, first.decode_kv_tokens) == ([(32, 0)], 1, 101)
    assert first.seconds == pytest.approx(COST.step_time([(32, 0)], 1, 101))
    finished = [f for r in results for f in r.finished]
    assert [f.request_id for f in finished] == ["d"]
    end = results[1].plan.end_s
    assert finished[0].tbt_s == pytest.approx(end / 2)
    assert engine.kv_tokens == 0


def profile(**changes):
    """COST on 4 layers; one layer of a 100-token prompt's KV moves in 2.5 ms."""
    return dataclasses.replace(simple_profile(1e7), cost=COST, num_layers=4, **changes)


def last_layer_s(num_tokens: int) -> float:
    """The hand-off `profile()` charges: one layer of the prompt's KV (1000 B a token)."""
    return num_tokens * 1000 / 4 / 1e7


def record(arrival_s: float, prompt: int, output: int, first_key: int) -> TraceRecord:
    blocks = (prompt + 9) // 10
    return TraceRecord(0, arrival_s, prompt, output, list(range(first_key, first_key + blocks)))


def simulate(records, **kwargs):
    config = RouterConfig(block_size=10, bypass_max_tokens=0)
    sim = StepSimulation(config, SimInstances(kwargs.pop("prof", profile()), 1, 1, 1000, **kwargs))
    return sim.run(records, progress=False)


def test_an_isolated_request_takes_its_chunked_prefill_plus_overhead():
    summary = simulate([record(0.0, 300, 1, 0)], prof=profile(request_overhead_s=0.02))
    expected_s = COST.prefill_time(300, 0) + 0.02 + last_layer_s(300)
    assert summary.ttft_mean_s == pytest.approx(expected_s)


def test_concurrent_prompts_share_the_prefill_engine():
    alone = simulate([record(0.0, 128, 1, 0)])
    both = simulate([record(0.0, 128, 1, 0), record(0.0, 128, 1, 1000)])
    # The second joins at the next step: [a0], [a1 b0] (one step constant), [b1].
    one_s = COST.prefill_step_time([(64, 0)])
    shared_s = COST.prefill_step_time([(64, 64), (64, 0)])
    a_s, b_s = one_s + shared_s, one_s + shared_s + one_s
    assert alone.ttft_mean_s == pytest.approx(2 * one_s + last_layer_s(128))
    assert both.ttft_mean_s == pytest.approx((a_s + b_s) / 2 + last_layer_s(128))
    assert alone.ttft_mean_s < both.ttft_mean_s < 2 * alone.ttft_mean_s


def test_handoff_is_paid_by_disaggregated_requests_only():
    prof = profile(request_overhead_s=0.01, handoff_s=0.05)
    plain = simulate([record(0.0, 128, 1, 0)], prof=prof)
    expected_s = COST.prefill_time(128, 0) + 0.06 + last_layer_s(128)
    assert plain.ttft_mean_s == pytest.approx(expected_s)
    config = RouterConfig(block_size=10, bypass_max_tokens=512, bypass_max_stall_s=1.0)
    sim = StepSimulation(config, SimInstances(prof, 1, 1, 1000))
    bypassed = sim.run([record(0.0, 128, 1, 0)], False)
    assert bypassed.bypassed == 1  # cheaper than the hand-off, so the Conductor bypasses
    assert bypassed.ttft_mean_s < plain.ttft_mean_s


def test_step_simulation_is_deterministic_and_serves_every_request():
    records = [record(i * 0.01, 50 + 37 * i, 1 + i % 7, 100 * i) for i in range(40)]
    first, again = simulate(records), simulate(records)
    assert first.served == 40 and first.rejected == 0
    assert dataclasses.replace(first, wall_s=0) == dataclasses.replace(again, wall_s=0)
    assert first.tbt_mean_s > 0


def test_simulate_steps_like_the_engine_with_a_chunked_profile(tmp_path, capsys):
    import json

    from halfmoon.router.profile import save_profile
    from halfmoon.router.sim.simulate import main

    save_profile(profile(), tmp_path / "chunked.yaml")
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 10 * i, "input_length": 300, "output_length": 5, "hash_ids": [0, i + 1]}
        for i in range(20)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--trace", str(trace), "--prefill", "1", "--decode", "1", "--policy", "conductor"]
    args += ["--profile", str(tmp_path / "chunked.yaml"), "--json", "--no-progress"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["served"] == 20
    assert summary["ttft_mean_s"] >= COST.prefill_time(300 - 256, 256)
    assert main([*args, "--max-batched-tokens", "0"]) == 2


def test_step_simulation_charges_each_prompt_its_own_hand_off():
    lengths = (100, 400, 200)
    records = [record(10.0 * i, n, 2, 1000 * i) for i, n in enumerate(lengths)]
    config = RouterConfig(block_size=10, bypass_max_tokens=0)
    sim = StepSimulation(config, SimInstances(profile(), 1, 1, 1000))
    summary = sim.run(records, progress=False)
    ttft, _ = sim.latencies()
    expected = [COST.prefill_time(n, 0) + last_layer_s(n) for n in lengths]
    assert list(ttft) == pytest.approx(expected)
    assert summary.ttft_pred_error_mean_s > 0
