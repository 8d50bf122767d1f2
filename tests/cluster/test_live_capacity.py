"""`halfmoon bench live-capacity`: its comparison, the cluster it reads from GetServerInfo and
the simulated side, on fixed numbers. The live run against a real cluster is in
test_bench_serve.py, on that module's cluster."""

from __future__ import annotations

import dataclasses

import pytest

from halfmoon.bench.studies.live_shape import (
    COLOCATED,
    DISAGGREGATED,
    ClusterShape,
    LiveCapacityError,
    default_slos,
    shape_from_server,
)
from halfmoon.bench.studies.live_sim import (
    compare,
    rates_from_capacity,
    simulate,
    simulated_capacity,
    to_records,
)
from halfmoon.bench.workload import BenchRequest, WorkloadError, random_requests
from halfmoon.router.config import RouterConfig
from halfmoon.router.errors import ProfileError
from halfmoon.router.profile import PROFILE_DIR, load_profile, profile_from_dict, profile_to_dict

PROFILE = load_profile(PROFILE_DIR / "cpu-tiny.yaml")


def details(**changes) -> dict:
    """GetServerInfo's details of a 1P+1D cluster, as the server sends them."""
    info = {
        "workers": {
            "prefill-0": {"kind": "prefill", "running": 0},
            "decode-0": {"kind": "decode", "running": 0},
            "decode-1": {"kind": "decode", "dead": True},
            "decode-2": {"kind": "decode", "draining": True},
        },
        "router": dataclasses.asdict(RouterConfig(policy="least_loaded", bypass_max_tokens=64)),
        "profile": profile_to_dict(PROFILE),
    }
    info.update(changes)
    return info


def test_agreement_is_the_attainment_difference_within_the_tolerance():
    rows = compare([1.0, 2.0, 3.0], [1.0, 0.85, 0.2], [0.95, 0.95, 0.5], 0.1)
    assert [round(r.difference, 6) for r in rows] == [0.05, -0.1, -0.3]
    assert [r.agrees for r in rows] == [True, True, False]
    assert rows[1].to_dict() == {
        "rate_rps": 2.0,
        "live_attainment": 0.85,
        "simulated_attainment": 0.95,
        "difference": pytest.approx(-0.1),
        "agrees": True,
    }
    with pytest.raises(ValueError, match="3 rates but 2 live"):
        compare([1.0, 2.0, 3.0], [1.0, 1.0], [1.0, 1.0, 1.0], 0.1)


def test_rates_are_fractions_of_the_simulated_capacity():
    assert rates_from_capacity(4.0, (0.5, 1.0, 1.5)) == [2.0, 4.0, 6.0]
    with pytest.raises(LiveCapacityError, match="lowest rate: loosen"):
        rates_from_capacity(0.0, (0.5, 1.0))
    with pytest.raises(LiveCapacityError, match="at once: tighten"):
        rates_from_capacity(float("inf"), (0.5, 1.0))


def test_the_cluster_is_read_from_server_info_counting_live_workers_only():
    shape = shape_from_server(details(), DISAGGREGATED, "tiny", None)
    assert (shape.num_prefill, shape.num_decode, shape.instances) == (1, 1, "1P+1D")
    assert shape.router.policy == "least_loaded" and shape.router.bypass_max_tokens == 64
    assert shape.profile == PROFILE
    mine = dataclasses.replace(PROFILE, name="mine")
    assert shape_from_server(details(), DISAGGREGATED, "tiny", mine).profile.name == "mine"
    colocated = details(workers={"w0": {"kind": "decode"}, "w1": {"kind": "decode"}})
    assert shape_from_server(colocated, COLOCATED, "tiny", None).instances == "2 colocated"


@pytest.mark.parametrize(
    ("changes", "mode", "error"),
    [
        ({}, "mixed", "neither"),
        ({"workers": {"d": {"kind": "decode"}}}, DISAGGREGATED, "no live worker"),
        ({"router": None}, DISAGGREGATED, "upgrade it"),
        ({"router": {"policy": "fastest"}}, DISAGGREGATED, "router settings are invalid"),
        ({"profile": {"name": "x"}}, DISAGGREGATED, "profile is invalid"),
        ({"profile": "yaml"}, DISAGGREGATED, "profile is invalid"),
    ],
)
def test_a_server_the_simulator_cannot_mirror_is_a_clear_error(changes, mode, error):
    with pytest.raises(LiveCapacityError, match=error):
        shape_from_server(details(**changes), mode, "tiny", None)


def test_a_profile_survives_the_wire_and_a_bad_field_is_named():
    assert profile_from_dict(profile_to_dict(PROFILE), "x") == PROFILE
    bad = {**profile_to_dict(PROFILE), "num_layers": [4]}
    with pytest.raises(ProfileError, match="num_layers"):
        profile_from_dict(bad, "from the server")


def test_records_keep_the_requests_lengths_and_times_with_fresh_blocks():
    requests = [BenchRequest([1] * 40, 8, 0.0), BenchRequest([2] * 16, 4, 0.5)]
    records = to_records(requests, None, 16)
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in records] == [
        (0.0, 40, 8),
        (0.5, 16, 4),
    ]
    assert [r.hash_ids for r in records] == [[0, 1, 2], [3]]
    assert to_records(requests, [[7, 8, 9], [7]], 16)[1].hash_ids == [7]


def shape(mode: str, prefill: int, decode: int) -> ClusterShape:
    return ClusterShape(mode, prefill, decode, RouterConfig(policy="least_loaded"), PROFILE, "t")


def test_the_simulated_side_meets_loose_slos_and_misses_tight_ones():
    requests = [BenchRequest([1] * 256, 16, i * 0.5) for i in range(48)]
    records = to_records(requests, None, 16)
    for mode, prefill in ((DISAGGREGATED, 1), (COLOCATED, 0)):
        cluster = shape(mode, prefill, 2 if mode == COLOCATED else 1)
        assert simulate(cluster, records, 16, 2048, (60.0, 10.0)).attainment == 1.0
        assert simulate(cluster, records, 16, 2048, (1e-6, 1e-6)).attainment == 0.0
        ttft, tbt = default_slos(cluster, 256, 16)
        assert ttft > 0 and tbt > 0
        capacity = simulated_capacity(cluster, records, 16, 2048, (ttft, tbt), 0.9)
        assert capacity > 0
        # Twice the capacity misses the target; half of it meets it.
        for factor, meets in ((0.5, True), (2.0, False)):
            scale = capacity / 2.0 * factor  # the records arrive at 2 req/s
            scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in records]
            attained = simulate(cluster, scaled, 16, 2048, (ttft, tbt)).attainment
            assert (attained >= 0.9) == meets, (mode, factor, attained)


def test_output_lengths_can_stay_fixed_while_prompts_vary():
    requests = random_requests(50, 100, 16, 0.5, range(6, 262), 0, output_range_ratio=0.0)
    assert {r.max_tokens for r in requests} == {16}
    assert len({len(r.prompt_token_ids) for r in requests}) > 10
    with pytest.raises(WorkloadError, match="--random-output-range-ratio 1.0"):
        random_requests(1, 10, 10, 0.0, range(6, 262), 0, output_range_ratio=1.0)
