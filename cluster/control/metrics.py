"""Prometheus metrics, all `halfmoon_`-prefixed and in base units (seconds, bytes), held in one
registry per `Metrics` so tests and several routers in a process never collide."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from halfmoon.kvstore.process_gc import gc_pause_histogram

OUTCOMES = ("finished", "rejected", "invalid", "cancelled", "deadline", "error")
# 5 ms to 10 minutes: a TTFT under load, an end-to-end latency or a queue wait.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
    10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# 1 ms to 5 s: one decode step.
TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
# 0.1 ms to 10 s: one (request, layer, chunk) KV transfer, or a TTFT prediction's error.
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
)  # fmt: skip
RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
# No `*_created` series beside every counter and histogram (docs/metrics.md lists no such names).
disable_created_metrics()


WORKER_LABELS = ("worker", "kind")
# (attribute, kind, name, help, labels, buckets): every metric `Metrics` records into.
METRICS: tuple[tuple[str, type, str, str, tuple[str, ...], tuple[float, ...]], ...] = (
    ("requests", Counter, "halfmoon_requests",
     "Requests by outcome (finished, rejected, invalid, cancelled, deadline, error); "
     "reason says why a request was rejected", ("outcome", "reason"), ()),
    ("ttft_seconds", Histogram, "halfmoon_time_to_first_token_seconds",
     "Arrival at the router to the first token sent", (), LATENCY_BUCKETS),
    ("inter_token_seconds", Histogram, "halfmoon_inter_token_latency_seconds",
     "Time between consecutive tokens of one request", (), TOKEN_BUCKETS),
    ("e2e_seconds", Histogram, "halfmoon_e2e_request_latency_seconds",
     "Arrival at the router to the last token of a finished request", (), LATENCY_BUCKETS),
    ("queue_seconds", Histogram, "halfmoon_queue_time_seconds",
     "Arrival at the router to the start of the request's prefill", (), LATENCY_BUCKETS),
    ("prompt_tokens", Counter, "halfmoon_prompt_tokens",
     "Prompt tokens of admitted requests", (), ()),
    ("generated_tokens", Counter, "halfmoon_generated_tokens",
     "Tokens generated and sent to clients", (), ()),
    ("cached_tokens", Counter, "halfmoon_cached_prompt_tokens",
     "Prompt tokens served from the KV cache (any tier) instead of prefilled", (), ()),
    ("slo_requests", Counter, "halfmoon_slo_requests",
     "Finished requests judged against an SLO (slo: ttft or tbt; attained: true or false)",
     ("slo", "attained"), ()),
    ("worker_running", Gauge, "halfmoon_worker_running_requests",
     "Requests in a worker's running batch", WORKER_LABELS, ()),
    ("worker_waiting", Gauge, "halfmoon_worker_waiting_requests",
     "Requests queued on a worker", WORKER_LABELS, ()),
    ("worker_waiting_tokens", Gauge, "halfmoon_worker_waiting_tokens",
     "Prompt tokens a worker has yet to prefill", WORKER_LABELS, ()),
    ("worker_pages_used_ratio", Gauge, "halfmoon_worker_kv_pages_used_ratio",
     "Fraction of a worker's KV pages in use (the device tier)", WORKER_LABELS, ()),
    ("prefix_cache_queried_tokens", Counter, "halfmoon_prefix_cache_queried_tokens",
     "Prompt tokens looked up in a cache tier (device, host, redis)", ("tier",), ()),
    ("prefix_cache_hit_tokens", Counter, "halfmoon_prefix_cache_hit_tokens",
     "Prompt tokens found in a cache tier (device, host, redis)", ("tier",), ()),
    ("kv_transfer_bytes", Counter, "halfmoon_kv_transfer_bytes",
     "KV bytes moved from prefill to decode (path: shm, object_store, nccl)", ("path",), ()),
    ("kv_transfer_seconds", Histogram, "halfmoon_kv_transfer_seconds",
     "Time to move one (request, layer, chunk) of KV", ("path",), TRANSFER_BUCKETS),
    ("ttft_prediction_error_seconds", Histogram, "halfmoon_router_ttft_prediction_error_seconds",
     "Absolute difference between the router's predicted and the actual TTFT", (),
     TRANSFER_BUCKETS),
    ("ttft_prediction_relative_error", Histogram, "halfmoon_router_ttft_prediction_relative_error",
     "Absolute TTFT prediction error divided by the actual TTFT", (), RATIO_BUCKETS),
    ("desired_replicas", Gauge, "halfmoon_autoscaler_desired_replicas",
     "Replicas the autoscaler wants in a pool", ("pool",), ()),
    ("actual_replicas", Gauge, "halfmoon_autoscaler_actual_replicas",
     "Replicas a pool has (serving, not draining)", ("pool",), ()),
)  # fmt: skip


class Metrics:
    """Every halfmoon metric: one attribute per row of METRICS. The router records requests and
    scrapes workers and stores into these; `registry` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(gc_pause_histogram())  # the router process's own collections
        for attribute, kind, name, doc, labels, buckets in METRICS:
            extra = {"buckets": buckets} if buckets else {}
            setattr(self, attribute, kind(name, doc, labels, registry=self.registry, **extra))
        self.store = StoreCollector()
        self.registry.register(self.store)

    def record_outcome(self, outcome: str, reason: str = "") -> None:
        """Count one request that ended with `outcome` (one of OUTCOMES)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
        self.requests.labels(outcome=outcome, reason=reason).inc()

    def record_slo(self, slo: str, attained: bool) -> None:
        """Count one finished request judged against the `slo` ("ttft" or "tbt") target."""
        self.slo_requests.labels(slo=slo, attained=str(attained).lower()).inc()

    def record_prefix_lookup(self, tier: str, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prompt's lookup in one cache tier."""
        self.prefix_cache_queried_tokens.labels(tier=tier).inc(queried_tokens)
        self.prefix_cache_hit_tokens.labels(tier=tier).inc(hit_tokens)

    def record_transfer(self, path: str, num_bytes: int, elapsed_s: float) -> None:
        """Count one KV transfer of `num_bytes` that took `elapsed_s`."""
        self.kv_transfer_bytes.labels(path=path).inc(num_bytes)
        self.kv_transfer_seconds.labels(path=path).observe(elapsed_s)

    def record_ttft_prediction(self, predicted_s: float, actual_s: float) -> None:
        """Record how far the router's TTFT prediction was from the measured TTFT."""
        error_s = abs(predicted_s - actual_s)
        self.ttft_prediction_error_seconds.observe(error_s)
        if actual_s > 0:
            self.ttft_prediction_relative_error.observe(error_s / actual_s)

    def update_worker(self, load: Any) -> None:
        """Set one worker's gauges from its load report (an engine.worker_info.WorkerLoad)."""
        labels = {"worker": load.name, "kind": load.kind}
        self.worker_running.labels(**labels).set(load.num_running)
        self.worker_waiting.labels(**labels).set(load.num_waiting)
        self.worker_waiting_tokens.labels(**labels).set(load.num_waiting_tokens)
        self.worker_pages_used_ratio.labels(**labels).set(load.pages_used_ratio)

    def remove_worker(self, worker: str, kind: str) -> None:
        """Drop a removed worker's gauges so dashboards stop showing its last values."""
        for gauge in (
            self.worker_running,
            self.worker_waiting,
            self.worker_waiting_tokens,
            self.worker_pages_used_ratio,
        ):
            try:
                gauge.remove(worker, kind)
            except KeyError:
                continue

    def update_pool(self, pool: str, desired: int, actual: int) -> None:
        """Set a pool's desired (autoscaler) and actual replica counts."""
        self.desired_replicas.labels(pool=pool).set(desired)
        self.actual_replicas.labels(pool=pool).set(actual)

    def update_store(self, store_node: str, stats: Mapping[str, Any]) -> None:
        """Replace the figures of store node `store_node` with a snapshot (`dataclasses.asdict` of a
        kvstore.stats.StoreStats)."""
        self.store.update(store_node, stats)

    def remove_store(self, store_node: str) -> None:
        """Forget a store node that is gone."""
        self.store.remove(store_node)


# (TierStats field, metric suffix, help) for counters the store keeps since it started.
TIER_COUNTERS = (
    ("hits", "hits", "Block reads served by the tier"),
    ("misses", "misses", "Block reads the tier could not serve"),
    ("evictions", "evictions", "Blocks evicted from the tier (least recently used first)"),
    ("corrupt", "corrupt_blocks", "Blocks dropped because their checksum did not match"),
    ("forged", "forged_blocks", "Redis records dropped because their HMAC did not match"),
    ("pool_timeouts", "pool_timeouts", "Redis calls that waited too long for a pooled connection"),
    ("errors", "errors", "Failed operations on the tier (e.g. Redis unreachable)"),
    ("bytes_written", "written_bytes", "Bytes written into the tier"),
    ("bytes_read", "read_bytes", "Bytes read from the tier"),
)
# (TierStats field, metric suffix, help) for what the tier holds now.
TIER_GAUGES = (
    ("blocks", "blocks", "Blocks the tier holds"),
    ("bytes_", "bytes", "Bytes the tier holds"),
    ("capacity_bytes", "capacity_bytes", "The tier's capacity in bytes"),
    ("leased_blocks", "leased_blocks", "Blocks pinned by a reader's lease"),
)
# (StoreStats field, from tier, to tier, help) for moves between tiers.
MOVES = (
    ("demotions", "host", "redis", "Blocks moved down a tier when evicted"),
    ("promotions", "redis", "host", "Blocks copied up a tier when read"),
)


class StoreCollector(Collector):
    """Exposes the latest stats snapshot of each store node: per tier contents and counters,
    moves between tiers, and put/get latency."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Mapping[str, Any]] = {}

    def update(self, store_node: str, stats: Mapping[str, Any]) -> None:
        """Keep `stats` as `store_node`'s current snapshot."""
        self._snapshots[store_node] = dict(stats)

    def remove(self, store_node: str) -> None:
        """Drop `store_node`'s snapshot."""
        self._snapshots.pop(store_node, None)

    def collect(self) -> Iterator[Metric]:
        """One family per figure, one sample per (store_node, tier)."""
        snapshots = sorted(self._snapshots.items())
        tiers = [(i, t, s) for i, stats in snapshots for t, s in _tiers(stats)]
        for kind, figures in (
            (GaugeMetricFamily, TIER_GAUGES),
            (CounterMetricFamily, TIER_COUNTERS),
        ):
            for field, suffix, doc in figures:
                family = kind(f"halfmoon_store_{suffix}", doc, labels=["store_node", "tier"])
                for store_node, tier, stats in tiers:
                    family.add_metric([store_node, tier], stats.get(field, 0))
                yield family
        yield from _moves(snapshots)
        yield from _latencies(snapshots)


def _tiers(stats: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(tier name, TierStats dict) for every tier a snapshot holds."""
    for name, value in stats.items():
        if isinstance(value, Mapping) and "capacity_bytes" in value:
            yield name, value


def _moves(snapshots: list[tuple[str, Mapping[str, Any]]]) -> Iterator[Metric]:
    labels = ["store_node", "from_tier", "to_tier"]
    for field, source, target, doc in MOVES:
        family = CounterMetricFamily(f"halfmoon_store_{field}", doc, labels=labels)
        for store_node, stats in snapshots:
            family.add_metric([store_node, source, target], stats.get(field, 0))
        yield family
    dropped = CounterMetricFamily(
        "halfmoon_store_demotions_dropped",
        "Blocks evicted without a demotion because the lower tier was down or backlogged",
        labels=["store_node"],
    )
    available = GaugeMetricFamily(
        "halfmoon_store_redis_available", "1 when the node reaches Redis", labels=["store_node"]
    )
    for store_node, stats in snapshots:
        dropped.add_metric([store_node], stats.get("demotions_dropped", 0))
        available.add_metric([store_node], float(bool(stats.get("redis_available", False))))
    yield dropped
    yield available


def _latencies(snapshots: list[tuple[str, Mapping[str, Any]]]) -> Iterator[Metric]:
    for op in ("put", "get"):
        family = SummaryMetricFamily(
            f"halfmoon_store_{op}_seconds", f"Latency of a layer-wise {op}", labels=["store_node"]
        )
        for store_node, stats in snapshots:
            latency = stats.get(f"{op}_latency") or {}
            family.add_metric([store_node], latency.get("count", 0), latency.get("total_s", 0.0))
        yield family


def start_metrics_server(
    metrics: Metrics, host: str = "127.0.0.1", port: int = 9400
) -> tuple[WSGIServer, int]:
    """Serve `metrics` at http://host:port/metrics (port 0: a free one) on a daemon thread;
    returns the server (call `.shutdown()` then `.server_close()`) and the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, server.server_address[1]
