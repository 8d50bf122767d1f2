"""A profile carries its tensor-parallel degree, and is scaled to another on paper by an explicit
efficiency per doubling of the devices."""

from __future__ import annotations

import pytest

from halfmoon.router.degree import profile_at_degree, tp_speedup
from halfmoon.router.errors import ProfileError
from halfmoon.router.profile import (
    DEFAULT_PROFILE,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)


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
    assert tp4.host_to_device_bytes_per_s == profile.host_to_device_bytes_per_s / 2
    assert tp4.network_bytes_per_s == profile.network_bytes_per_s
    assert tp4.assumptions["tp_efficiency_per_doubling"] == 0.85
    assert profile_at_degree(profile, 8) is profile


def test_a_degree_whose_devices_cannot_hold_the_weights_is_refused():
    with pytest.raises(ProfileError, match="at degree 1: .* hold no KV .* use a higher degree"):
        profile_at_degree(load_profile(DEFAULT_PROFILE), 1)


def _fields() -> dict:
    data = profile_to_dict(load_profile(DEFAULT_PROFILE))
    del data["tensor_parallel_size"]
    return data
