"""A profile carries its tensor-parallel degree (one per side when composed for pools at two
degrees), and is scaled to another on paper by an explicit efficiency per doubling of the
devices; the router's instances carry their degree."""

from __future__ import annotations

import logging

import pytest
from router_testkit import simple_profile

from halfmoon.engine.outputs import StepTiming
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.degree import profile_at_degree, profile_for_pools, tp_speedup
from halfmoon.router.errors import ProfileError
from halfmoon.router.profile import (
    DEFAULT_PROFILE,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from halfmoon.router.reports import EngineStep
from halfmoon.router.request import RouteRequest


def test_the_70b_profiles_are_timed_at_degree_8_and_a_saved_profile_keeps_its_degree(tmp_path):
    profile = load_profile(DEFAULT_PROFILE)
    assert profile.tensor_parallel_size == 8
    save_profile(profile_at_degree(profile, 4), tmp_path / "tp4.yaml")
    assert load_profile(tmp_path / "tp4.yaml").tensor_parallel_size == 4


@pytest.mark.parametrize("value", [0, 1.5, True, "2"])
def test_a_degree_that_is_not_a_positive_int_is_refused_naming_it(value):
    with pytest.raises(ProfileError, match=r"`tensor_parallel_size` = .* must be an int >= 1"):
        profile_from_dict({"tensor_parallel_size": value, **_fields()}, "p.yaml")


def test_each_doubling_speeds_a_step_by_twice_the_efficiency():
    assert tp_speedup(16, 8, 0.85) == pytest.approx(1.7)
    assert tp_speedup(2, 8, 0.85) == pytest.approx(1 / 1.7**2)
    assert tp_speedup(8, 8, 0.85) == 1.0


def test_a_profile_at_half_its_degree_is_slower_and_holds_what_its_devices_hold_beside_weights():
    profile = load_profile(DEFAULT_PROFILE)  # 8 devices; 4.4e11 B of KV beside 1.4e11 of weights
    tp4 = profile_at_degree(profile, 4, efficiency=0.85)
    assert tp4.name == "llama70b-8xa800@tp4"
    assert tp4.cost.prefill_time(1000) == pytest.approx(profile.cost.prefill_time(1000) * 1.7)
    assert tp4.cost.decode_step_time(8, 4096) == pytest.approx(
        profile.cost.decode_step_time(8, 4096) * 1.7
    )
    per_device = (profile.decode_kv_capacity_tokens * 327680 + 1.4e11) / 8
    assert tp4.decode_kv_capacity_tokens == int((4 * per_device - 1.4e11) // 327680)
    # Half the node's devices: half its PCIe links, NICs and host DRAM.
    assert tp4.host_to_device_bytes_per_s == profile.host_to_device_bytes_per_s / 2
    assert tp4.network_bytes_per_s == profile.network_bytes_per_s / 2
    assert tp4.cache_bytes_per_instance == profile.cache_bytes_per_instance / 2
    assert tp4.assumptions["tp_efficiency_per_doubling"] == 0.85
    assert profile_at_degree(profile, 8) is profile


def test_a_degree_whose_devices_cannot_hold_the_weights_is_refused_naming_the_side():
    profile = load_profile(DEFAULT_PROFILE)
    with pytest.raises(ProfileError, match="at prefill degree 1: .* hold no KV .* higher prefill"):
        profile_at_degree(profile, 1)
    with pytest.raises(ProfileError, match="at decode degree 1: 1 devices of 7.25e"):
        profile_for_pools(profile, 8, 1)


def test_pools_at_two_degrees_time_each_side_at_its_own_and_hold_decode_kv_at_decode_degree():
    profile = load_profile(DEFAULT_PROFILE)
    tp4 = profile_at_degree(profile, 4)
    prefill_tp4 = profile_for_pools(profile, 4, 8)
    assert prefill_tp4.name == "llama70b-8xa800@tp4/8"
    assert (prefill_tp4.tensor_parallel_size, prefill_tp4.decode_degree) == (4, 8)
    assert prefill_tp4.cost.prefill_coef == tp4.cost.prefill_coef
    assert prefill_tp4.cost.decode_coef == profile.cost.decode_coef
    assert prefill_tp4.decode_kv_capacity_tokens == profile.decode_kv_capacity_tokens
    assert prefill_tp4.cache_bytes_per_instance == tp4.cache_bytes_per_instance  # prefill's side
    decode_tp4 = profile_for_pools(profile, 8, 4)
    assert decode_tp4.name == "llama70b-8xa800@tp8/4"
    assert decode_tp4.cost.prefill_coef == profile.cost.prefill_coef
    assert decode_tp4.cost.decode_coef == tp4.cost.decode_coef
    assert decode_tp4.decode_kv_capacity_tokens == tp4.decode_kv_capacity_tokens
    assert decode_tp4.network_bytes_per_s == profile.network_bytes_per_s


def test_a_composed_profile_keeps_both_degrees_when_saved_and_scales_each_side_from_its_own(
    tmp_path,
):
    profile = load_profile(DEFAULT_PROFILE)
    save_profile(profile_for_pools(profile, 4, 8), tmp_path / "tp4-8.yaml")
    composed = load_profile(tmp_path / "tp4-8.yaml")
    assert (composed.tensor_parallel_size, composed.decode_tensor_parallel_size) == (4, 8)
    back = profile_at_degree(composed, 8)
    assert back.name == "llama70b-8xa800@tp8"
    assert back.decode_tensor_parallel_size is None
    assert back.cost.prefill_coef == pytest.approx(profile.cost.prefill_coef)
    assert back.cost.decode_coef == profile.cost.decode_coef
    assert back.decode_kv_capacity_tokens == profile.decode_kv_capacity_tokens
    with pytest.raises(ProfileError, match="`decode_tensor_parallel_size` = 0 must be an int"):
        profile_from_dict({"decode_tensor_parallel_size": 0, **_fields()}, "p.yaml")


def _composed_conductor() -> Conductor:
    """A conductor whose profile times prefill at degree 4 and decode at 2."""
    profile = simple_profile()
    profile.tensor_parallel_size, profile.decode_tensor_parallel_size = 4, 2
    return Conductor(RouterConfig(block_size=10, bypass_max_tokens=0), profile)


def test_instances_carry_their_degree_and_a_decision_names_both(caplog):
    conductor = _composed_conductor()
    with caplog.at_level(logging.WARNING, logger="halfmoon.router.degree"):
        prefill = conductor.add_instance("p0", "prefill").prefill
        decode = conductor.add_instance("d0", "decode", tensor_parallel_size=2).decode
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (4, 2)
    assert caplog.records == []
    decision = conductor.route(_request("r0"), now=0.0)
    assert (decision.prefill_degree, decision.decode_degree) == (4, 2)
    assert "prefill=p0 decode=d0 tp=4/2" in conductor.explain("r0")


def test_an_instance_at_another_degree_than_the_profile_is_kept_at_its_own_with_a_warning(caplog):
    conductor = _composed_conductor()
    with caplog.at_level(logging.WARNING, logger="halfmoon.router.degree"):
        view = conductor.add_instance("p1", "prefill", tensor_parallel_size=2).prefill
    assert view.tensor_parallel_size == 2
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "prefill instance p1 runs at tensor-parallel degree 2, but the router's profile test "
        "times prefill at degree 4: its predicted step times are off by about 1.70x"
    )


def test_steps_of_a_worker_at_another_degree_do_not_refit_that_side():
    def prefill_steps(conductor: Conductor, degree: int) -> None:
        for n in range(1, 200):
            step = StepTiming(((n, n % 5),), 0, 0, seconds=0.01 * n, started=0.0)
            conductor.observe(EngineStep(step, tensor_parallel_size=degree))

    at_decode_degree, at_prefill_degree = _composed_conductor(), _composed_conductor()
    prefill_steps(at_decode_degree, 2)  # a short prompt bypassed to a decode worker
    prefill_steps(at_prefill_degree, 4)
    untouched = at_decode_degree.view().profile.cost
    assert untouched.prefill_coef == simple_profile().cost.prefill_coef
    assert at_prefill_degree.view().profile.cost.prefill_coef[1] == pytest.approx(0.01)


def _request(request_id: str) -> RouteRequest:
    return RouteRequest(request_id, [1, 2], 20, 5, 0.0)


def _fields() -> dict:
    data = profile_to_dict(load_profile(DEFAULT_PROFILE))
    del data["tensor_parallel_size"]
    return data
