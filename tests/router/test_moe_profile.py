import json

import pytest
from test_simulator import write_trace

from halfmoon.router.profile import load_profile
from halfmoon.router.sim.expert_parallel import DEEPSEEK_V3_EXPERTS, H800, ExpertParallel
from halfmoon.router.sim.moe_profile import (
    H200,
    MOE_PROFILE,
    QWEN3_30B_A3B,
    QWEN3_32B,
    Efficiency,
    build_profile,
    decode_step_s,
    write_profile,
)
from halfmoon.router.sim.simulate import main

EFF = Efficiency()


def test_shapes_have_their_published_parameter_counts():
    assert QWEN3_30B_A3B.total_params() == pytest.approx(30.5e9, rel=0.01)
    assert QWEN3_30B_A3B.active_params() == pytest.approx(3.3e9, rel=0.02)
    assert QWEN3_32B.total_params() == pytest.approx(32.8e9, rel=0.01)
    assert QWEN3_30B_A3B.kv_bytes_per_token() == 48 * 4 * 128 * 2 * 2


def test_shipped_moe_profile_is_what_the_module_computes():
    profile = load_profile(MOE_PROFILE)
    assert profile == build_profile(QWEN3_30B_A3B, H200)
    assert profile.tensor_parallel_size == 1


def test_profile_written_by_the_module_reads_back_unchanged(tmp_path):
    profile = build_profile(QWEN3_32B, H200)
    write_profile(profile, tmp_path / "dense.yaml")
    assert load_profile(tmp_path / "dense.yaml") == profile


def test_moe_prefill_scales_with_active_parameters():
    moe = build_profile(QWEN3_30B_A3B, H200).cost.prefill_coef[1]
    dense = build_profile(QWEN3_32B, H200).cost.prefill_coef[1]
    # 2.73B vs 31.2B non-embedding parameters a token computes with
    assert dense / moe == pytest.approx(11.4, abs=0.1)


def test_moe_decode_step_grows_as_the_distinct_experts_a_batch_touches():
    experts = QWEN3_30B_A3B.experts
    expert_s = QWEN3_30B_A3B.num_layers * experts.params * 2 / (H200.hbm_bytes_per_s * 0.6)
    steps = {b: decode_step_s(QWEN3_30B_A3B, H200, EFF, b, 0) for b in (1, 2, 16, 64, 4096)}
    for b, step in steps.items():
        distinct = 128 * (1 - (1 - 8 / 128) ** b)
        assert step - steps[1] == pytest.approx((distinct - 8) * expert_s + 1.6e-5 * (b - 1))
    # sublinear: each further token finds more of its experts already read
    assert (steps[64] - steps[16]) / 48 < (steps[16] - steps[2]) / 14 < steps[2] - steps[1]
    every_expert = decode_step_s(QWEN3_30B_A3B, H200, EFF, 1, 0) + 120 * expert_s
    assert steps[4096] - 1.6e-5 * 4095 == pytest.approx(every_expert, rel=1e-9)


def test_dense_decode_step_reads_every_weight_whatever_the_batch():
    one, many = (decode_step_s(QWEN3_32B, H200, EFF, b, 0) for b in (1, 64))
    assert many - one == pytest.approx(63 * EFF.per_seq_s)


def test_profile_decode_fit_stays_near_the_curve_over_the_batches_it_holds():
    profile = load_profile(MOE_PROFILE)
    low, high = profile.assumptions["decode_fit_batches"]
    assert (low, high) == (1, 711427 // 12000)
    for b in (1, 8, 32, high):
        curve = decode_step_s(QWEN3_30B_A3B, H200, EFF, b, b * 12000)
        assert profile.cost.decode_step_time(b, b * 12000) == pytest.approx(curve, rel=0.45)


def test_expert_parallel_spreads_the_batch_over_the_experts():
    decode = ExpertParallel(DEEPSEEK_V3_EXPERTS, H800, ep_degree=144, batch_per_gpu=90)
    assert decode.tokens_per_expert() == pytest.approx(90 * 144 * 8 / 256)
    assert ExpertParallel(DEEPSEEK_V3_EXPERTS, H800, 8, 64).all_to_all_s() == 0.0
    assert decode.all_to_all_s() == pytest.approx(58 * 90 * 8 * 7168 * 3 * (136 / 144) / 4e10)


def test_a_short_simulation_with_the_moe_profile_completes(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, num_requests=120)
    args = ["--trace", str(trace), "--prefill", "2", "--decode", "1", "--policy", "conductor"]
    assert main([*args, "--profile", str(MOE_PROFILE), "--json", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["served"] == result["requests"] == 120
    assert result["ttft_mean_s"] > 0 and result["tbt_mean_s"] > 0
