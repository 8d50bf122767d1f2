"""`bench replay`'s per-request comparison, without a cluster: the relative TTFT prediction
error, the cache-use sums, and live and simulated requests matched by trace order."""

from __future__ import annotations

import dataclasses
import math

import pytest
from router_testkit import simple_profile

from halfmoon.bench.studies import replay, replay_predictions
from halfmoon.bench.studies.replay_predictions import PredictionFigures, RequestView
from halfmoon.router.config import RouterConfig
from halfmoon.router.cost_model import CostModel
from halfmoon.router.decision import Decision
from halfmoon.router.profile import Profile
from halfmoon.router.sim.simulation import SimInstances
from halfmoon.router.sim.step_simulation import make_simulation
from halfmoon.router.sim.trace import TraceRecord


def view(predicted_s, ttft_s, cached=0, fetched=0, queue_s=None) -> RequestView:
    return RequestView(predicted_s, queue_s, ttft_s, cached, fetched, None, "p0", "d0", "finished")


def summary(request_id: str, predicted_s: float, ttft_s: float) -> dict:
    """A row as `RouterActor.summaries` returns it."""
    return {
        "request_id": request_id,
        "outcome": "finished",
        "prefill_instance": "prefill-0",
        "decode_instance": "decode-0",
        "num_prompt_tokens": 64,
        "num_output_tokens": 4,
        "num_cached_tokens": 32,
        "num_loaded_tokens": 16,
        "loaded_from": "redis",
        "predicted_ttft_s": predicted_s,
        "ttft_s": ttft_s,
    }


def test_relative_errors_are_signed_sorted_and_skip_missing_figures():
    views = [view(1.5, 1.0), view(None, 1.0), view(0.5, None), view(0.2, 0.4), view(1.0, 0.0)]
    assert replay_predictions.relative_errors(views) == [-0.5, 0.5]


def test_prediction_error_median_and_p90_interpolate_the_absolute_errors():
    views = [view(1.2, 1.0), view(0.5, 1.0), view(2.0, 1.0), view(1.0, 1.0)]
    figures = replay_predictions.prediction_figures(views)
    assert (figures.requests, figures.predicted) == (4, 4)
    assert figures.error_p50 == pytest.approx(0.35)  # of 0, 0.2, 0.5, 1.0
    assert figures.error_p90 == pytest.approx(0.85)
    assert figures.bias_p50 == pytest.approx(0.1)  # of -0.5, 0, 0.2, 1.0


def test_prediction_figures_sum_cached_tokens_and_count_fetches_and_bypasses():
    bypassed = RequestView(1.0, None, 1.0, 16, 0, None, None, "d0", "finished")
    views = [view(1.0, 1.0, 32, 16), view(1.0, 1.0, 48, 0), view(1.0, 1.0, 0, 0), bypassed]
    figures = replay_predictions.prediction_figures(views)
    assert (figures.cached_tokens, figures.fetches, figures.fetched_tokens) == (96, 1, 16)
    assert figures.bypassed == 1


def test_queued_counts_the_views_that_know_their_predicted_queue():
    views = [view(1.0, 1.0, queue_s=0.5), view(1.0, 1.0, queue_s=0.0), view(1.0, 1.0)]
    assert replay_predictions.num_queued(views) == 1
    assert replay_predictions.num_queued(views[2:]) is None


def test_prediction_error_without_any_prediction_is_nan():
    figures = replay_predictions.prediction_figures([view(None, 1.0)])
    assert figures.predicted == 0 and math.isnan(figures.error_p50)


def test_live_views_follow_the_sent_ids_and_leave_forgotten_ones_out():
    ids = replay_predictions.request_ids(3)
    views = replay_predictions.live_views(
        [summary(ids[2], 0.3, 0.6), summary(ids[0], 0.1, 0.2)], ids
    )
    assert [v and v.predicted_ttft_s for v in views] == [0.1, None, 0.3]
    assert views[0] == RequestView(
        0.1, None, 0.2, 32, 16, "redis", "prefill-0", "decode-0", "finished"
    )


def test_common_views_keep_the_requests_every_side_reports():
    live = [view(1.0, 1.0), None, view(3.0, 3.0)]
    sim = [view(1.5, 1.0), view(2.0, 2.0), None]
    assert replay_predictions.common_views({"live": live, "sim": sim}) == {
        "live": live[:1],
        "sim": sim[:1],
    }


def test_prediction_summary_gives_live_over_simulated_cache_hits():
    sides = {
        "live": [view(1.0, 1.0, 30), view(1.0, 2.0, 10)],
        "simulated": [view(1.0, 1.0, 20), view(1.0, 1.0, 0)],
        "simulated_startup_profile": [view(1.0, 1.0, 0), view(1.0, 1.0, 0)],
    }
    predictions = replay_predictions.prediction_summary(sides)
    assert predictions["cached_live_over_sim"] == 2.0
    assert PredictionFigures(**predictions["live"]).error_p90 == pytest.approx(0.45)


def test_a_simulated_bypass_starts_cold_and_a_rejection_has_no_ttft():
    bypass = Decision("0", "conductor", "d0", "d0", 0.2, predicted_queue_s=0.1, bypass=True)
    assert replay_predictions.simulated_view(bypass, 0.25) == RequestView(
        0.2, 0.1, 0.25, 0, 0, None, None, "d0", "finished"
    )
    rejected = Decision("1", "conductor", rejected=True, reason="no room")
    assert replay_predictions.simulated_view(rejected, math.inf) == RequestView(
        None, None, None, 0, 0, None, None, None, "rejected"
    )


def test_simulated_views_follow_trace_order_and_see_a_shared_prefix_cached():
    config = RouterConfig(block_size=16, bypass_max_tokens=0)
    sim = make_simulation(config, SimInstances(profile(), 2, 1, 1000))
    records = [TraceRecord(i, 0.5 * i, 64, 4, [0, 1, 2, 10 + i]) for i in range(3)]
    sim.run(records, progress=False)
    views = replay_predictions.simulated_views(sim)
    ttfts, _ = sim.latencies()
    assert [v.ttft_s for v in views] == pytest.approx(ttfts.tolist())
    assert [v.num_cached_tokens for v in views] == [0, 48, 48]
    assert all(v.predicted_ttft_s > 0 and v.predicted_queue_s >= 0 for v in views)


def test_simulated_figures_are_the_summary_headline_in_its_order():
    sim = make_simulation(RouterConfig(block_size=16), SimInstances(profile(), 1, 1, 1000))
    summary = sim.run([TraceRecord(i, 0.5 * i, 64, 4, [i]) for i in range(3)], progress=False)
    figures = replay_predictions.figures_of(summary)
    assert [f.name for f in dataclasses.fields(figures)] == list(replay_predictions.FIGURE_FIELDS)
    assert (figures.requests, figures.rejected) == (3, 0)
    assert figures.ttft_p99_s == summary.ttft_p99_s


def test_request_rows_pair_each_record_with_every_side():
    records = [TraceRecord(1, 0.0, 64, 4, [0]), TraceRecord(2, 0.5, 32, 2, [1])]
    sides = {"live": [view(1.0, 1.0), None], "simulated": [view(1.5, 1.0), view(2.0, 1.0)]}
    rows = replay_predictions.request_rows(records, sides)
    assert [row["request_id"] for row in rows] == ["replay-0", "replay-1"]
    assert rows[1]["live"] is None and rows[1]["simulated"]["predicted_ttft_s"] == 2.0
    assert (rows[1]["arrival_s"], rows[1]["num_prompt_tokens"]) == (0.5, 32)


def test_workers_share_the_cores_when_they_outnumber_them(monkeypatch):
    monkeypatch.setattr(replay.os, "cpu_count", lambda: 2)
    assert (replay.worker_cpus(2), replay.worker_cpus(4)) == (1.0, 0.5)


def profile() -> Profile:
    """Prefill 0.1 ms a token in 64-token chunks; decode steps 4 ms."""
    cost = CostModel((0.001, 1e-4, 0.0, 0.0), (0.004, 1e-4, 0.0), chunk_tokens=64)
    return dataclasses.replace(simple_profile(), cost=cost, num_layers=4)
