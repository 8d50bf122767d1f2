import pytest
from router_testkit import conductor_and_views, make_conductor, request

from halfmoon.router.events import DecodeJoined
from halfmoon.router.reports import DecodeLoad


def test_ttft_exactly_at_the_slo_is_admitted():
    conductor = make_conductor(admission="early_rejection", ttft_slo_s=0.1)
    decision = conductor.route(request("r"), 0.0)
    assert decision.predicted_ttft_s == pytest.approx(0.1)
    assert not decision.rejected


def test_ttft_just_over_the_slo_is_rejected_with_both_figures():
    conductor = make_conductor(admission="early_rejection", ttft_slo_s=0.0999)
    decision = conductor.route(request("r"), 0.0)
    assert decision.rejected
    assert decision.reason == "predicted TTFT 0.100s on p0 exceeds the TTFT SLO 0.100s"
    assert "REJECTED" in conductor.explain("r")


def test_a_rejected_request_takes_no_queue_or_pages():
    conductor, views = conductor_and_views(admission="early_rejection", ttft_slo_s=0.01)
    conductor.route(request("r"), 0.0)
    assert all(views[f"p{i}"].num_queued == 0 for i in range(3))
    assert all(views[f"d{i}"].reserved_tokens == 0 for i in range(2))


def test_no_admission_accepts_whatever_the_prediction():
    conductor = make_conductor(ttft_slo_s=0.01)
    assert not conductor.route(request("r"), 0.0).rejected


def test_request_slo_override_beats_the_configured_one():
    conductor = make_conductor(admission="early_rejection", ttft_slo_s=10.0)
    assert conductor.route(request("r", ttft_slo_s=0.05), 0.0).rejected


@pytest.mark.parametrize(("slo", "rejected"), [(0.016, False), (0.0159, True)])
def test_tbt_at_the_slo_boundary(slo, rejected):
    conductor = make_conductor(num_decode=1, admission="early_rejection", tbt_slo_s=slo)
    conductor.observe(DecodeLoad("d0", 5, 0))
    decision = conductor.route(request("r"), 0.0)
    assert decision.rejected is rejected
    if rejected:
        assert decision.reason == "predicted TBT 0.0160s on d0 exceeds the TBT SLO 0.0159s"


def test_prediction_admits_when_the_batch_will_have_drained_by_prefill_end():
    # d0 runs 5 requests now, each expected to finish within 100 tokens x 15 ms = 1.5 s;
    # the new request's prefill ends at 2 s, when the batch will have drained.
    modes = {}
    for mode in ("early_rejection", "prediction_early_rejection"):
        conductor, views = conductor_and_views(num_decode=1, admission=mode, tbt_slo_s=0.0155)
        for i in range(5):
            conductor.route(request(f"old{i}", first_key=100 * (i + 1)), 0.0)
            conductor.on_event(DecodeJoined(f"old{i}", 0.0))
        conductor.observe(DecodeLoad("d0", 5, 5 * 150))
        for i in range(3):
            views[f"p{i}"].enqueue(2.0, 0, 0.0)
        modes[mode] = conductor.route(request("new"), 0.0)
    assert modes["early_rejection"].rejected
    assert not modes["prediction_early_rejection"].rejected
    assert modes["prediction_early_rejection"].predicted_tbt_s == pytest.approx(0.011)


def test_prediction_counts_requests_whose_prefill_ends_before_ours():
    conductor = make_conductor(
        num_decode=1, admission="prediction_early_rejection", tbt_slo_s=0.0125
    )
    conductor.route(request("a", first_key=100), 0.0)
    conductor.route(request("b", first_key=200), 0.0)
    # a and b join d0 at 0.1 s, before "late" finishes its prefill behind them.
    decision = conductor.route(request("late", first_key=300), 0.0)
    assert decision.predicted_tbt_s == pytest.approx(0.013)
    assert decision.rejected
