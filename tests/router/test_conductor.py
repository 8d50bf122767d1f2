import dataclasses

import pytest
from router_testkit import (
    conductor_and_views,
    make_conductor,
    request,
    serve_late,
    simple_profile,
    stored,
)

from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.errors import RouterConfigError
from halfmoon.router.events import Abandoned, DecodeJoined, Finished, FirstToken, PrefillDone
from halfmoon.router.reports import DecodeLoad, PrefillLoad, RequestOverhead
from halfmoon.router.request import RouteRequest
from halfmoon.router.views import PrefillView


def test_explain_lists_candidates_and_the_winner():
    conductor = make_conductor()
    stored(conductor, "p2", "host", range(5))
    conductor.route(request("r"), 0.0)
    text = conductor.explain("r")
    assert "prefill=p2 decode=d0" in text
    assert "5 local blocks" in text
    assert text.count("prefill ") == 3


def test_explain_keeps_only_the_last_decisions():
    conductor = make_conductor(explain_capacity=2)
    for rid in "abc":
        conductor.route(request(rid), 0.0)
    with pytest.raises(KeyError, match="explain_capacity"):
        conductor.explain("a")
    assert "request c" in conductor.explain("c")


def test_prediction_error_is_recorded_from_observed_ttft():
    conductor = make_conductor()
    conductor.route(request("r"), 0.0)
    conductor.on_event(FirstToken("r", 0.15, 0.15))
    stats = conductor.view().prediction_error()
    assert stats.count == 1
    assert stats.mean_abs_s == pytest.approx(0.05)
    assert stats.mean_rel == pytest.approx(0.05 / 0.15)


def test_routing_counts_queued_work_until_the_prefill_finishes():
    conductor, views = conductor_and_views(num_prefill=1)
    conductor.route(request("a"), 0.0)
    assert views["p0"].wait_s(0.0) == pytest.approx(0.1)
    assert views["p0"].wait_s(0.05) == pytest.approx(0.05)
    conductor.on_event(PrefillDone("a", 0.1))
    assert views["p0"].wait_s(0.1) == 0.0


def test_requests_sent_at_once_each_wait_for_all_sent_before():
    # Sixteen prompts at once to one instance: the last waits for fifteen prefills, and it
    # keeps waiting for them until they finish (dispatch does not take them off the queue).
    conductor, views = conductor_and_views(num_prefill=1)
    decisions = [conductor.route(request(f"r{i}"), 0.0) for i in range(16)]
    queues = [d.predicted_queue_s for d in decisions]
    assert queues == pytest.approx([0.1 * i for i in range(16)])
    assert views["p0"].wait_s(0.0) == pytest.approx(1.6)


def test_a_finish_later_than_predicted_moves_the_work_behind_it():
    conductor, views = conductor_and_views(num_prefill=1)
    for rid in ("a", "b", "c"):
        conductor.route(request(rid), 0.0)
    view = views["p0"]
    conductor.on_event(PrefillDone("a", 0.3))  # predicted 0.1: b and c are still to do, from now
    assert view.wait_s(0.3) == pytest.approx(0.2)
    conductor.on_event(PrefillDone("b", 0.35))  # earlier than now predicted (0.4)
    assert view.wait_s(0.35) == pytest.approx(0.1)
    conductor.on_event(Finished("c", 0.36, 1))  # cancelled before its prefill finished
    assert view.wait_s(0.36) == 0.0
    assert view.num_queued == 0


def test_a_worker_report_resets_the_estimate_when_every_request_is_there():
    conductor, views = conductor_and_views(num_prefill=1)
    conductor.route(request("a"), 0.0)
    conductor.route(request("b"), 0.0)
    view = views["p0"]
    conductor.observe(PrefillLoad("p0", 1, 0, 0.05))  # one of the two still on its way: ignored
    assert view.wait_s(0.05) == pytest.approx(0.15)
    conductor.observe(PrefillLoad("p0", 2, 0, 0.05))
    assert view.wait_s(0.05) == 0.0


def test_finish_releases_the_decode_reservation():
    conductor, views = conductor_and_views(num_decode=1)
    conductor.route(request("a"), 0.0)
    view = views["d0"]
    assert view.reserved_tokens == 100 + 100
    conductor.on_event(DecodeJoined("a", 0.1))
    assert conductor.on_event(Finished("a", 1.0, 100))
    assert view.reserved_tokens == 0
    assert not view.admitted


def test_a_request_too_big_for_any_decode_instance_is_rejected():
    conductor = make_conductor()
    big = RouteRequest("big", [1], 10, max_output_tokens=2_000_000, arrival_s=0.0)
    decision = conductor.route(big, 0.0)
    assert decision.rejected
    assert "no decode instance has 2000010 tokens of KV free" in decision.reason


def test_removed_instance_is_no_longer_a_candidate_or_a_holder():
    conductor = make_conductor()
    stored(conductor, "p1", "host", range(10))
    conductor.remove_instance("p1")
    decision = conductor.route(request("r"), 0.0)
    assert decision.prefill_instance != "p1"
    assert decision.cached_tokens == 0


def test_handoff_is_learned_online_and_counted_in_predictions_and_admission():
    conductor = make_conductor(1, 1)
    alone = conductor.route(request("a"), now=0.0).predicted_ttft_s  # 100 tokens: 0.1 s
    conductor.observe(RequestOverhead(0.01))
    for i, seconds in enumerate((0.2, 0.4, -1.0)):  # a negative measurement counts as zero
        conductor.on_event(FirstToken(f"h{i}", 0.0, 0.1, handoff_s=seconds))
    assert conductor.view().profile.handoff_s == pytest.approx(0.2)
    again = conductor.route(request("b", first_key=500), now=0.0).predicted_ttft_s
    assert again == pytest.approx(alone + 0.1 + 0.01 + 0.2)  # queued behind "a", + overheads
    strict = make_conductor(1, 1, admission="early_rejection", ttft_slo_s=0.25)
    strict.on_event(FirstToken("h", 0.0, 0.1, handoff_s=0.2))
    decision = strict.route(request("c"), now=0.0)
    assert decision.rejected and "predicted TTFT 0.300s" in decision.reason
    conductor.observe(RequestOverhead(0.02))  # measured apart from the hand-off: it stays
    assert conductor.view().profile.handoff_s == pytest.approx(0.2)


def test_a_bypassed_prompt_skips_the_handoff():
    conductor = make_conductor(1, 1, bypass_max_tokens=512, bypass_max_stall_s=1.0)
    before = conductor.route(request("a", num_blocks=5), now=0.0)
    assert not before.bypass  # an idle prefill instance is as fast, with no hand-off to pay
    conductor.on_event(FirstToken("h", 0.0, 0.1, handoff_s=0.5))
    after = conductor.route(request("b", num_blocks=5, first_key=100), now=0.0)
    assert after.bypass


def test_colocated_requests_decode_where_they_prefill_and_go_where_their_prefix_is():
    config = RouterConfig(block_size=10, bypass_max_tokens=0)
    conductor = Conductor(config, simple_profile(), colocated=True)
    for name in ("w0", "w1"):
        conductor.add_instance(name, "both")
    stored(conductor, "w1", "device", range(5))
    decision = conductor.route(request("a"), 0.0)
    assert (decision.prefill_instance, decision.decode_instance) == ("w1", "w1")
    assert decision.cached_tokens == 50
    # w1's queue now holds a's work; a cold prompt goes to the idle w0.
    cold = conductor.route(RouteRequest("b", [99], 100, 100, 0.0), 0.0)
    assert (cold.prefill_instance, cold.decode_instance) == ("w0", "w0")


def test_a_node_store_is_near_to_its_workers_and_another_node_store_is_a_fetch():
    conductor = make_conductor(num_prefill=0)
    conductor.add_instance("p0", "prefill", node="store-a")
    conductor.add_instance("p1", "prefill", node="store-b")
    stored(conductor, "store-a", "host", range(8))
    decision = conductor.route(request("a"), 0.0)
    assert decision.prefill_instance == "p0"
    assert decision.fetch_from is None and decision.local_cached_tokens == 80
    assert "(8 in its node's store)" in conductor.explain("a")


def test_a_request_predicted_past_max_ttft_is_rejected_whatever_the_admission_mode():
    conductor, views = conductor_and_views(num_prefill=1, max_ttft_s=0.25)
    decisions = [conductor.route(request(f"r{i}"), 0.0) for i in range(4)]
    # 0.1 s of prefill each: the third would wait 0.2 s and take 0.3 s in all.
    assert [d.rejected for d in decisions] == [False, False, True, True]
    assert "exceeds router.max_ttft_s 0.250s" in decisions[2].reason
    assert views["p0"].num_queued == 2


def test_the_ttft_bound_scales_predictions_by_how_much_recent_ones_fell_short():
    conductor = make_conductor(num_prefill=1, max_ttft_s=0.25)
    first = conductor.route(request("r0"), 0.0)
    conductor.on_event(PrefillDone("r0", 0.1))
    # Ten requests predicted at 0.1 s or more waited twice as long: r1 (0.1 s, alone) is
    # taken as a 0.2 s wait and admitted; r2 behind it (0.2 s, taken as 0.4 s) is not.
    for i in range(10):
        serve_late(conductor, f"late{i}", 10, 0.1, ttft_s=0.2)
    second, third = (conductor.route(request(f"r{i}"), 0.1) for i in (1, 2))
    assert not first.rejected and not second.rejected and third.rejected
    assert "(2.00x, as recent requests waited)" in third.reason
    # Shortfalls of predictions under a quarter of the bound say little and are left out.
    small = make_conductor(num_prefill=1, max_ttft_s=0.25)
    for i in range(10):
        serve_late(small, f"late{i}", 5, 0.0, ttft_s=0.5)
    assert [small.route(request(f"s{i}"), 0.0).rejected for i in range(3)] == [False, False, True]


def test_the_ttft_bound_scales_by_the_worst_shortfall_until_ten_are_known():
    conductor = make_conductor(num_prefill=1, max_ttft_s=0.35)
    serve_late(conductor, "late0", 10, 0.0, ttft_s=0.15)
    serve_late(conductor, "late1", 10, 0.0, ttft_s=0.3)  # 3x: r1 behind r0 (0.2 s): 0.6 s
    assert not conductor.route(request("r0"), 0.0).rejected
    assert conductor.route(request("r1", first_key=500), 0.0).rejected
    assert "(3.00x, as recent requests waited)" in conductor.view().decision("r1").reason


def test_a_request_alone_on_an_idle_worker_is_admitted_whatever_its_prediction():
    # A cost model far slower than the machine (1 s a prompt against a 0.25 s bound) would
    # otherwise refuse every request, and never be refit from one served.
    conductor = make_conductor(num_prefill=1, max_ttft_s=0.25)
    assert not conductor.route(request("alone", num_blocks=100), 0.0).rejected
    assert conductor.route(request("behind", first_key=500), 0.0).rejected


def test_a_prefill_running_past_its_predicted_end_scales_the_bound_before_any_is_served():
    conductor = make_conductor(num_prefill=1, max_ttft_s=0.25)
    assert not conductor.route(request("r0"), 0.0).rejected  # predicted done at 0.1 s
    # At 0.3 s it has not finished: 3x late at least, so r1 (0.1 s of work) is 0.3 s.
    late = conductor.route(request("r1", first_key=500), 0.3)
    assert late.rejected and "(3.00x, as recent requests waited)" in late.reason
    conductor.on_event(PrefillDone("r0", 0.3))  # nothing waits past its prediction any more
    assert not conductor.route(request("r2", first_key=900), 0.3).rejected


def _chunked_conductor() -> tuple[Conductor, PrefillView]:
    """One prefill instance whose engine prefills in 10-token chunks (processor sharing)."""
    profile = simple_profile()
    profile.cost = dataclasses.replace(profile.cost, chunk_tokens=10)
    conductor, views = conductor_and_views(num_prefill=1, profile=profile)
    return conductor, views["p0"]


def test_a_chunking_engine_shares_its_steps_so_a_short_prompt_waits_its_own_length():
    conductor, view = _chunked_conductor()
    conductor.route(request("long", num_blocks=100), 0.0)  # 1.0 s of prefill
    short = conductor.route(request("short", first_key=500), 0.0)  # 0.1 s
    # Sharing every step with the long one until it is done: 0.1 s of the long one's work.
    assert short.predicted_queue_s == pytest.approx(0.1)
    assert view.wait_s(0.1) == pytest.approx(1.1 - 0.1)  # both ran at half speed
    assert [job.left_s for job in view.jobs] == pytest.approx([0.95, 0.05])
    conductor.on_event(PrefillDone("short", 0.2))  # later than predicted (0.2 s shared: on time)
    assert [job.left_s for job in view.jobs] == pytest.approx([0.9])


def test_a_chunking_engine_refuses_a_prompt_that_would_slow_one_there_past_the_bound():
    profile = simple_profile()
    profile.cost = dataclasses.replace(profile.cost, chunk_tokens=10)
    conductor = make_conductor(num_prefill=1, profile=profile, max_ttft_s=1.05)
    assert not conductor.route(request("long", num_blocks=100), 0.0).rejected  # 1.0 s
    # 0.2 s for itself, but sharing the steps it would make the long one take 1.1 s.
    short = conductor.route(request("short", first_key=500), 0.0)
    assert short.predicted_ttft_s == pytest.approx(0.2) and short.rejected
    assert "slow a request already there to a TTFT of 1.100s" in short.reason
    # Half a second on, 0.5 s left: the short one's 0.1 s keeps it at 1.1 s from arrival.
    assert conductor.route(request("later", first_key=900), 0.5).rejected
    fifo = make_conductor(num_prefill=1, max_ttft_s=1.15)  # first come: nothing slows down
    fifo.route(request("long", num_blocks=100), 0.0)
    assert not fifo.route(request("short", first_key=500), 0.0).rejected


def test_a_shared_views_predicted_ends_give_each_job_its_share_of_every_step():
    view = PrefillView("p0", shared=True)
    for work_s in (0.3, 0.1, 0.2):
        view.enqueue(work_s, 10, 0.0)
    # With 0.15 s more: 0.1 ends after 4 x 0.1; 0.2 after 0.1 + 0.15 + 2 x 0.2; 0.3 after all.
    assert [left for _, left in view.ends_with(0.0, 0.15)] == pytest.approx([0.75, 0.4, 0.65])
    assert [waited for waited, _ in view.ends_with(0.25, 0.0)] == [0.25] * 3


def test_a_worker_report_taken_before_the_last_update_has_the_work_since_taken_off():
    view = PrefillView("p0")
    view.enqueue(1.0, 10, 0.0)
    view.enqueue(1.0, 10, 0.0)
    assert view.wait_s(0.5) == pytest.approx(1.5)
    # The worker counted 1.2 s left at 0.2 (its last step's end): shared as predicted (1:2),
    # 0.4 and 0.8; by 0.5 it has done 0.3 s more, the first job's first.
    view.reconcile(2, 1.2, as_of=0.2)
    assert [job.left_s for job in view.jobs] == pytest.approx([0.1, 0.8])
    assert view.updated_s == 0.5


def test_sharing_a_sliver_of_time_below_the_floats_resolution_ends():
    view = PrefillView("p0", shared=True)
    for work_s in (1.0, 1.0, 1.0):
        view.enqueue(work_s, 10, 0.0)
    view._work_off(5e-324)  # a third of it rounds to 0: the loop once went on forever
    assert [job.left_s for job in view.jobs] == [1.0, 1.0, 1.0]


def test_first_come_first_served_a_short_prompt_waits_for_the_long_one():
    conductor = make_conductor(num_prefill=1)
    conductor.route(request("long", num_blocks=100), 0.0)
    short = conductor.route(request("short", first_key=500), 0.0)
    assert short.predicted_queue_s == pytest.approx(1.0)


def test_an_abandoned_request_is_released_once():
    conductor, views = conductor_and_views(num_prefill=1, num_decode=1)
    conductor.route(request("a"), 0.0)
    assert conductor.on_event(Abandoned("a", 0.05)) is True
    assert conductor.on_event(Abandoned("a", 0.06)) is False
    assert views["p0"].num_queued == 0 and views["d0"].reserved_tokens == 0


def test_an_unknown_role_event_or_report_is_refused_naming_what_is_accepted():
    conductor = make_conductor()
    with pytest.raises(RouterConfigError, match="choose one of prefill, decode, both"):
        conductor.add_instance("x", "router")
    with pytest.raises(TypeError, match="router/events.py"):
        conductor.on_event(DecodeLoad("d0", 1, 1))
    with pytest.raises(TypeError, match="router/reports.py"):
        conductor.observe(PrefillDone("a", 0.0))
