import pytest
from router_testkit import conductor_and_views, request, simple_profile, stored

from halfmoon.router.config import RouterConfig
from halfmoon.router.errors import RouterConfigError
from halfmoon.router.events import Replicated
from halfmoon.router.replication import HotPrefixTracker, Replication
from halfmoon.router.sim.prefill_instance import CACHE_TIER
from halfmoon.router.sim.simulation import SimInstances, Simulation
from halfmoon.router.sim.trace import TraceRecord

PREFIX = list(range(8))  # eight of a request's ten 10-token blocks, held by p0
REPLICATE = {"replicate": True, "replicate_min_hits": 2, "replicate_margin_s": 0.01}


def replicating(network_bytes_per_s: float = 1e3, **config):
    """Three prefill instances; p0 holds PREFIX and has 30 ms queued, p1 and p2 are idle;
    by default the network is too slow for any fetch to pay. Returns the conductor and the
    views it keeps of its instances."""
    config = {**REPLICATE, **config}
    profile = simple_profile(network_bytes_per_s)
    conductor, views = conductor_and_views(profile=profile, **config)
    stored(conductor, "p0", "host", PREFIX)
    views["p0"].enqueue(0.03, 30)
    return conductor, views


def test_a_hot_prefix_on_a_busy_instance_is_replicated_to_the_idle_one():
    conductor, _ = replicating()
    first = conductor.route(request("a"), 0.0)
    second = conductor.route(request("b"), 0.0)
    # p0 wins both (its 30 ms queue + 20 ms of new tokens beats 100 ms uncached elsewhere), so
    # it queues 70 ms while p1 stays idle: the second access makes the prefix hot.
    assert (first.prefill_instance, second.prefill_instance) == ("p0", "p0")
    assert first.replications == []
    assert second.replications == [Replication(tuple(PREFIX), ("p0", "host"), "p1", 80)]
    assert "replicate 8 hot blocks (80 tokens to move) from ('p0', 'host') to p1" in (
        conductor.explain("b")
    )


def test_a_cold_prefix_is_not_replicated():
    conductor, _ = replicating(replicate_min_hits=3)
    decisions = [conductor.route(request(rid), 0.0) for rid in "abc"]
    assert [len(d.replications) for d in decisions] == [0, 0, 1]


def test_a_prefix_held_by_max_copies_instances_is_not_replicated():
    conductor, views = replicating(replicate_max_copies=2)
    stored(conductor, "p2", "host", PREFIX)
    views["p2"].enqueue(0.03, 30)
    decisions = [conductor.route(request(rid), 0.0) for rid in "abcd"]
    assert all(d.replications == [] for d in decisions)


def test_no_copy_when_the_idle_instance_does_not_beat_the_holders_by_the_margin():
    conductor, _ = replicating(replicate_margin_s=1.0)
    decisions = [conductor.route(request(rid), 0.0) for rid in "abcd"]
    assert all(d.replications == [] for d in decisions)


def test_a_copy_in_flight_blocks_another_of_the_same_prefix_until_it_lands():
    conductor, _ = replicating(replicate_cooldown_s=5.0)
    conductor.route(request("a"), 0.0)
    (copy,) = conductor.route(request("b"), 0.0).replications
    assert conductor.route(request("c"), 0.0).replications == []
    conductor.on_event(Replicated(copy, 0.0))
    (again,) = conductor.route(request("d"), 0.0).replications
    assert (again.keys, again.target) == (copy.keys, "p2")  # d went to p1, p2 is the idle one


def test_a_copy_that_never_reports_back_stops_blocking_after_the_cooldown():
    conductor, _ = replicating(replicate_cooldown_s=5.0)
    conductor.route(request("a"), 0.0)
    assert len(conductor.route(request("b"), 0.0).replications) == 1
    assert len(conductor.route(request("c"), 6.0).replications) == 1


def test_a_landed_copy_counts_toward_max_copies():
    conductor, _ = replicating(replicate_max_copies=2)
    conductor.route(request("a"), 0.0)
    (copy,) = conductor.route(request("b"), 0.0).replications
    stored(conductor, copy.target, "host", copy.keys)
    conductor.on_event(Replicated(copy, 0.0))
    assert conductor.route(request("c"), 0.0).replications == []


def test_an_instance_that_fetches_a_hot_prefix_gets_the_copy():
    conductor, views = replicating(network_bytes_per_s=1e12)
    views["p0"].enqueue(10.0, 10_000)
    first = conductor.route(request("a"), 0.0)
    second = conductor.route(request("b"), 0.0)
    # p0 has 10 s queued, so p1 and then p2 fetch its prefix; the second fetch is the hot one.
    assert (first.prefill_instance, first.fetch_from) == ("p1", ("p0", "host"))
    assert (second.prefill_instance, second.fetch_from) == ("p2", ("p0", "host"))
    assert first.replications == []
    assert second.replications == [Replication(tuple(PREFIX), ("p0", "host"), "p2", 80)]


def test_replication_is_off_by_default_and_routing_is_unchanged():
    assert RouterConfig().replicate is False
    plain, views = conductor_and_views(profile=simple_profile(1e3))
    copying, _ = replicating()
    stored(plain, "p0", "host", PREFIX)
    views["p0"].enqueue(0.03, 30)
    for rid in "abcdef":
        off, on = plain.route(request(rid), 0.0), copying.route(request(rid), 0.0)
        assert off.replications == []
        assert (off.prefill_instance, off.decode_instance, off.predicted_ttft_s) == (
            on.prefill_instance,
            on.decode_instance,
            on.predicted_ttft_s,
        )
    assert plain.view().num_replications_planned == 0
    assert copying.view().num_replications_planned == 1


def test_accesses_are_forgotten_after_two_windows():
    tracker = HotPrefixTracker(window_requests=2)
    assert tracker.record([1, 2, 3], 3, min_hits=2) == 0
    assert tracker.record([1, 2], 2, min_hits=2) == 2
    assert tracker.record([1], 1, min_hits=3) == 1
    assert tracker.hits(1) == 3
    assert tracker.record([9], 1, min_hits=1) == 1
    assert tracker.record([9], 1, min_hits=1) == 1
    assert tracker.hits(1) == 1  # the first window rotated out; the third access stays
    assert tracker.record([9], 1, min_hits=1) == 1
    assert tracker.hits(1) == 1
    assert tracker.record([9], 1, min_hits=1) == 1
    assert tracker.hits(1) == 0


def test_only_a_contiguous_hot_run_from_the_first_block_is_hot():
    tracker = HotPrefixTracker(window_requests=100)
    tracker.record([1, 2, 3], 3, min_hits=1)
    tracker.record([1, 7, 3], 3, min_hits=1)
    assert tracker.record([1, 7, 3], 3, min_hits=2) == 3
    assert tracker.record([1, 2, 4], 3, min_hits=3) == 1


@pytest.mark.parametrize(
    "knob",
    [
        {"replicate_min_hits": 0},
        {"replicate_max_copies": 0},
        {"replicate_window_requests": 1.5},
        {"replicate_margin_s": -1.0},
        {"replicate_cooldown_s": float("inf")},
        {"replicate_margin_s": True},
    ],
)
def test_impossible_replication_knobs_are_rejected(knob):
    with pytest.raises(RouterConfigError, match=next(iter(knob))):
        RouterConfig(**knob)


def test_simulated_replications_land_in_the_target_cache_and_the_index():
    # One request caches a 10-block prefix on p0; a second later a burst shares it, one every
    # 10 ms, 20 ms of work each on p0 (120 ms elsewhere), a copy taking 100 ms to move.
    records = [
        TraceRecord(i, 0.0 if i == 0 else 1.0 + 0.01 * i, 120, 4, [*range(10), 100 + i, 200 + i])
        for i in range(30)
    ]
    config = RouterConfig(block_size=10, bypass_max_tokens=0, replicate_max_copies=3, **REPLICATE)
    instances = SimInstances(simple_profile(network_bytes_per_s=1e6), 3, 1, 10_000)
    simulation = Simulation(config, instances)
    summary = simulation.run(records, progress=False)
    view = simulation.conductor.view()
    copies = [c for i in range(30) for c in view.decision(str(i)).replications]
    assert [(c.source, c.target) for c in copies] == [
        (("p0", "host"), "p1"),
        (("p1", "host"), "p2"),  # the least busy holder once request 17 queued on p0
    ]
    assert summary.replications == 2
    assert view.num_replications_planned == len(copies)
    for copy in copies:
        target = simulation.prefill[copy.target]
        assert target.prefix_depth(copy.keys) == len(copy.keys)
        held = simulation.index.longest_prefix(copy.keys).get((copy.target, CACHE_TIER), 0)
        assert held == len(copy.keys)
    # Requests after the first copy landed (at 1.12 s) on p1 read the copied prefix there.
    after = [view.decision(str(i)) for i in range(13, 20)]
    assert any(d.prefill_instance == "p1" and d.cached_tokens == 100 for d in after)
