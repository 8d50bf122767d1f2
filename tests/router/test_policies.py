import random

import pytest
from router_testkit import conductor_and_views, make_conductor, request, simple_profile, stored

from halfmoon.router.config import POLICY_NAMES, RouterConfig
from halfmoon.router.errors import InvalidRequestError, RouterConfigError
from halfmoon.router.policies import POLICIES, make_policy
from halfmoon.router.reports import DecodeLoad


def test_every_configured_policy_name_has_an_implementation():
    assert tuple(POLICIES) == POLICY_NAMES


def test_unknown_policy_is_a_config_error_listing_the_names():
    with pytest.raises(RouterConfigError, match="unknown routing policy 'fastest'.*conductor"):
        RouterConfig(policy="fastest")
    with pytest.raises(RouterConfigError, match="round_robin"):
        make_policy("fastest")


@pytest.mark.parametrize("slo", [0, -1.0, float("inf"), float("nan")])
def test_impossible_slo_is_a_config_error(slo):
    with pytest.raises(RouterConfigError, match="ttft_slo_s"):
        RouterConfig(ttft_slo_s=slo)
    with pytest.raises(RouterConfigError, match="tbt_slo_s"):
        RouterConfig(tbt_slo_s=slo)


def test_impossible_slo_override_on_a_request_is_rejected_as_invalid():
    conductor = make_conductor()
    with pytest.raises(InvalidRequestError, match="ttft_slo_s = -2"):
        conductor.route(request("r", ttft_slo_s=-2), 0.0)


def test_admission_without_any_slo_is_a_config_error():
    with pytest.raises(RouterConfigError, match="set ttft_slo_s or tbt_slo_s"):
        RouterConfig(admission="early_rejection")


def test_round_robin_cycles_through_instances():
    conductor = make_conductor(policy="round_robin")
    chosen = [conductor.route(request(str(i)), 0.0) for i in range(4)]
    assert [d.prefill_instance for d in chosen] == ["p0", "p1", "p2", "p0"]
    assert [d.decode_instance for d in chosen] == ["d0", "d1", "d0", "d1"]


def test_random_policy_is_deterministic_for_a_seed():
    first = [make_conductor(policy="random", seed=7) for _ in range(2)]
    picks = [[c.route(request(str(i)), 0.0).prefill_instance for i in range(20)] for c in first]
    assert picks[0] == picks[1]
    assert set(picks[0]) == {"p0", "p1", "p2"}


def test_least_loaded_ignores_the_cache_and_takes_the_shortest_queue():
    conductor, views = conductor_and_views(policy="least_loaded")
    stored(conductor, "p0", "host", range(10))
    views["p0"].enqueue(0.5, 100)
    views["p1"].enqueue(0.2, 100)
    decision = conductor.route(request("r"), 0.0)
    assert decision.prefill_instance == "p2"
    assert decision.cached_tokens == 0


def test_cache_aware_local_prefers_the_instance_holding_the_prefix():
    conductor = make_conductor(policy="cache_aware_local")
    stored(conductor, "p1", "host", range(8))
    decision = conductor.route(request("r"), 0.0)
    assert decision.prefill_instance == "p1"
    assert decision.cached_tokens == 80
    assert decision.predicted_ttft_s == pytest.approx(0.020)


def route_past_a_busy_holder(**settings):
    """Route one request whose prefix only p1 holds, behind 0.5 s of queued prefill."""
    conductor, views = conductor_and_views(**settings)
    stored(conductor, "p1", "host", range(8))
    views["p1"].enqueue(0.5, 500)
    return conductor.route(request("r"), 0.0)


def test_cache_aware_local_leaves_a_holder_that_is_too_busy():
    decision = route_past_a_busy_holder(policy="cache_aware_local")
    assert decision.prefill_instance == "p0"
    assert decision.fetch_from is None
    assert decision.predicted_ttft_s == pytest.approx(0.100)


def test_conductor_fetches_the_prefix_from_a_busy_holder():
    decision = route_past_a_busy_holder(policy="conductor")
    assert decision.prefill_instance == "p0"
    assert decision.fetch_from == ("p1", "host")
    assert decision.fetch_tokens == 80
    # 20 new tokens at 1 ms plus 80 tokens x 1000 bytes at 1e12 B/s.
    assert decision.predicted_ttft_s == pytest.approx(0.020 + 80e3 / 1e12)


def test_conductor_skips_a_fetch_that_costs_more_than_it_saves():
    slow_network = simple_profile(network_bytes_per_s=1e6)
    decision = route_past_a_busy_holder(policy="conductor", profile=slow_network)
    assert decision.prefill_instance == "p0"
    assert decision.fetch_from is None
    assert decision.predicted_ttft_s == pytest.approx(0.100)


def test_conductor_picks_the_decode_instance_with_the_lowest_predicted_tbt():
    conductor = make_conductor(policy="conductor")
    conductor.observe(DecodeLoad("d0", 30, 0))
    conductor.observe(DecodeLoad("d1", 5, 0))
    decision = conductor.route(request("r"), 0.0)
    assert decision.decode_instance == "d1"
    assert decision.predicted_tbt_s == pytest.approx(0.01 + 6e-3)


def test_conductor_always_picks_a_minimum_predicted_ttft_instance():
    rng = random.Random(1234)
    for trial in range(200):
        num_prefill = rng.randint(1, 8)
        conductor, views = conductor_and_views(num_prefill, policy="conductor")
        names = [f"p{i}" for i in range(num_prefill)]
        for name in names:
            if rng.random() < 0.6:
                stored(conductor, name, rng.choice(["host", "device"]), range(rng.randint(0, 10)))
            if rng.random() < 0.7:
                views[name].enqueue(rng.uniform(0, 0.2), 10)
            views[name].enqueue(rng.uniform(0, 0.1), 10)
        decision = conductor.route(request(f"r{trial}", num_blocks=rng.randint(1, 12)), 0.0)
        prefill = [c for c in decision.candidates if c.role == "prefill"]
        assert len(prefill) == len(names)
        chosen = next(c for c in prefill if c.instance == decision.prefill_instance)
        assert chosen.predicted_s == min(c.predicted_s for c in prefill)
        assert decision.predicted_ttft_s == chosen.predicted_s


def test_short_prompt_bypasses_to_the_decode_instance():
    conductor, views = conductor_and_views(policy="conductor", bypass_max_tokens=50)
    for name in ("p0", "p1", "p2"):
        views[name].enqueue(1.0, 100)
    decision = conductor.route(request("short", num_blocks=3), 0.0)
    assert decision.bypass
    assert decision.prefill_instance == decision.decode_instance == "d0"
    long = conductor.route(request("long", num_blocks=10), 0.0)
    assert not long.bypass


def test_bypass_is_refused_when_the_stall_would_break_the_tbt_slo():
    conductor, views = conductor_and_views(policy="conductor", bypass_max_tokens=50, tbt_slo_s=0.03)
    for name in ("p0", "p1", "p2"):
        views[name].enqueue(1.0, 100)
    decision = conductor.route(request("short", num_blocks=3), 0.0)
    assert not decision.bypass
