"""/metrics over real HTTP shows exactly what was recorded."""

from __future__ import annotations

import dataclasses
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.cluster.control.metrics import Metrics, start_metrics_server
from halfmoon.kvstore.stats import StoreStats


@pytest.fixture
def served():
    """A Metrics and a function that scrapes it from a live server on a free port."""
    metrics = Metrics()
    server, port = start_metrics_server(metrics, "127.0.0.1", 0)

    def scrape() -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    yield metrics, scrape
    server.shutdown()
    server.server_close()


def test_request_outcomes_and_tokens_are_counted(served):
    metrics, scrape = served
    for _ in range(3):
        metrics.record_outcome("finished")
    metrics.record_outcome("rejected", "ttft_slo")
    metrics.record_outcome("cancelled")
    metrics.prompt_tokens.inc(120)
    metrics.generated_tokens.inc(30)
    metrics.cached_tokens.inc(64)
    metrics.record_slo("ttft", True)
    metrics.record_slo("ttft", False)
    samples = scrape()
    assert samples[("halfmoon_requests_total", (("outcome", "finished"), ("reason", "")))] == 3
    rejected = (("outcome", "rejected"), ("reason", "ttft_slo"))
    assert samples[("halfmoon_requests_total", rejected)] == 1
    assert samples[("halfmoon_requests_total", (("outcome", "cancelled"), ("reason", "")))] == 1
    assert samples[("halfmoon_prompt_tokens_total", ())] == 120
    assert samples[("halfmoon_generated_tokens_total", ())] == 30
    assert samples[("halfmoon_cached_prompt_tokens_total", ())] == 64
    assert samples[("halfmoon_slo_requests_total", (("attained", "true"), ("slo", "ttft")))] == 1


def test_latency_histograms_count_and_bucket_observations(served):
    metrics, scrape = served
    for seconds in (0.02, 0.2, 3.0):
        metrics.ttft_seconds.observe(seconds)
    metrics.inter_token_seconds.observe(0.012)
    metrics.e2e_seconds.observe(4.0)
    metrics.queue_seconds.observe(0.001)
    samples = scrape()
    assert samples[("halfmoon_time_to_first_token_seconds_count", ())] == 3
    assert samples[("halfmoon_time_to_first_token_seconds_sum", ())] == pytest.approx(3.22)
    assert samples[("halfmoon_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 2
    assert samples[("halfmoon_inter_token_latency_seconds_bucket", (("le", "0.015"),))] == 1
    assert samples[("halfmoon_e2e_request_latency_seconds_count", ())] == 1
    assert samples[("halfmoon_queue_time_seconds_bucket", (("le", "0.005"),))] == 1


def test_worker_gauges_follow_load_reports_and_removal(served):
    metrics, scrape = served
    load = SimpleNamespace(
        name="decode-0",
        kind="decode",
        num_running=5,
        num_waiting=2,
        num_waiting_tokens=300,
        pages_used_ratio=0.25,
    )
    metrics.update_worker(load)
    labels = (("kind", "decode"), ("worker", "decode-0"))
    samples = scrape()
    assert samples[("halfmoon_worker_running_requests", labels)] == 5
    assert samples[("halfmoon_worker_waiting_requests", labels)] == 2
    assert samples[("halfmoon_worker_waiting_tokens", labels)] == 300
    assert samples[("halfmoon_worker_kv_pages_used_ratio", labels)] == 0.25
    metrics.remove_worker("decode-0", "decode")
    assert ("halfmoon_worker_running_requests", labels) not in scrape()


def test_cache_transfer_prediction_and_pool_figures(served):
    metrics, scrape = served
    metrics.record_prefix_lookup("host", queried_tokens=256, hit_tokens=192)
    metrics.record_transfer("shm", 4096, 0.002)
    metrics.record_transfer("shm", 4096, 0.004)
    metrics.record_ttft_prediction(predicted_s=0.5, actual_s=0.4)
    metrics.update_pool("prefill", desired=3, actual=2)
    samples = scrape()
    assert samples[("halfmoon_prefix_cache_queried_tokens_total", (("tier", "host"),))] == 256
    assert samples[("halfmoon_prefix_cache_hit_tokens_total", (("tier", "host"),))] == 192
    assert samples[("halfmoon_kv_transfer_bytes_total", (("path", "shm"),))] == 8192
    assert samples[("halfmoon_kv_transfer_seconds_count", (("path", "shm"),))] == 2
    error = samples[("halfmoon_router_ttft_prediction_error_seconds_sum", ())]
    assert error == pytest.approx(0.1)
    relative = samples[("halfmoon_router_ttft_prediction_relative_error_sum", ())]
    assert relative == pytest.approx(0.25)
    assert samples[("halfmoon_autoscaler_desired_replicas", (("pool", "prefill"),))] == 3
    assert samples[("halfmoon_autoscaler_actual_replicas", (("pool", "prefill"),))] == 2


def test_store_snapshot_sets_tier_figures_and_moves(served):
    metrics, scrape = served
    stats = StoreStats(demotions=7, promotions=2, redis_available=True)
    stats.host.blocks, stats.host.bytes_, stats.host.capacity_bytes = 10, 40960, 1 << 20
    stats.host.evictions, stats.redis.hits = 4, 9
    stats.get_latency.record(0.5)
    metrics.update_store("node-a", dataclasses.asdict(stats))
    samples = scrape()
    host = (("store_node", "node-a"), ("tier", "host"))
    assert samples[("halfmoon_store_blocks", host)] == 10
    assert samples[("halfmoon_store_bytes", host)] == 40960
    assert samples[("halfmoon_store_capacity_bytes", host)] == 1 << 20
    assert samples[("halfmoon_store_evictions_total", host)] == 4
    redis = (("store_node", "node-a"), ("tier", "redis"))
    assert samples[("halfmoon_store_hits_total", redis)] == 9
    moved = (("from_tier", "host"), ("store_node", "node-a"), ("to_tier", "redis"))
    assert samples[("halfmoon_store_demotions_total", moved)] == 7
    assert samples[("halfmoon_store_redis_available", (("store_node", "node-a"),))] == 1
    assert samples[("halfmoon_store_get_seconds_sum", (("store_node", "node-a"),))] == 0.5
    stats.host.evictions = 6
    metrics.update_store("node-a", dataclasses.asdict(stats))
    assert scrape()[("halfmoon_store_evictions_total", host)] == 6
    metrics.remove_store("node-a")
    assert ("halfmoon_store_blocks", host) not in scrape()


def test_an_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="outcome 'lost' is not one of finished"):
        Metrics().record_outcome("lost")


def test_two_metrics_objects_do_not_share_counts():
    first, second = Metrics(), Metrics()
    first.prompt_tokens.inc(5)
    assert second.registry.get_sample_value("halfmoon_prompt_tokens_total") == 0
