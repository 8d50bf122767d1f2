"""The router actor: hosts the gRPC frontend, the OpenAI HTTP API and /metrics, routes with the
Conductor, and keeps the Conductor's views and prefix index fed from worker and store reports."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path

import ray

from halfmoon.cluster.config import ClusterConfig, router_config, served_name
from halfmoon.cluster.control.metrics_targets import MetricsTargets
from halfmoon.cluster.frontend.auth import loopback
from halfmoon.cluster.serving.calibration import calibrate
from halfmoon.cluster.serving.clients import StoreClient, worker_client
from halfmoon.cluster.serving.cluster_backend import ClusterBackend
from halfmoon.cluster.serving.request_metrics import RequestMetrics
from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.cluster.serving.workers import PollReport, Worker
from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.engine.llm_engine import StepTiming
from halfmoon.engine.loop_watchdog import LoopWatchdog, watch_loop
from halfmoon.engine.tokenizer import load_tokenizer
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.router.profile import Profile

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.25
# Engine steps kept for `observed_steps` (a replay fits its live profile from them).
OBSERVED_STEPS = 50_000
TRAFFIC_WINDOW_S = 60.0  # seconds of finished requests the pool signals average by default
RELEASE_AT_STOP_S = 5.0
POOLS = ("prefill", "decode")


class RouterActor:
    """One per cluster: the frontend clients talk to and the Conductor that places requests."""

    def __init__(self, config: ClusterConfig) -> None:
        # Created before the workers answer, so this process starts (and imports) while they
        # load the model; `setup` gives it what it needs from them.
        from halfmoon.cluster.control.metrics import Metrics

        self.config = config
        self.metrics = Metrics()
        self.backend: ClusterBackend | None = None
        self.tokenizer = None
        self.requests = RequestMetrics(self.metrics, config.slo.ttft_s)
        self.steps_observed: deque[StepTiming] = deque(maxlen=OBSERVED_STEPS)
        self.grpc_server = None
        self.http_server = None
        self.drain = None
        self.grammars = None
        self.metrics_server = None
        self.targets = MetricsTargets(config.server.metrics_targets_file)
        self._poller: asyncio.Task | None = None
        self.watchdog: LoopWatchdog | None = None

    async def setup(self, info: WorkerInfo, profile: Profile) -> None:
        """The model's facts (from a worker) and the cost profile: the Conductor and the backend."""
        config = self.config
        self.tokenizer = load_tokenizer(Path(info.model))
        bound = None if config.router.admission == "none" else config.router.max_queued_per_worker
        self.backend = ClusterBackend(
            self.tokenizer,
            info,
            router_config(config, info.block_size),
            profile,
            config.mode,
            served_name(config),
            bound,
            pool_wait_s=config.router.pool_wait_s,
        )
        self.backend.set_observer(self._observe)

    async def start(self) -> dict:
        """Start the gRPC API, the OpenAI HTTP API and /metrics; returns the bound ports
        (`http_port` None when the HTTP API is off)."""
        from halfmoon.cluster.control.metrics import start_metrics_server
        from halfmoon.cluster.frontend.drain import Drain
        from halfmoon.cluster.frontend.grammar_checks import GrammarChecks
        from halfmoon.cluster.frontend.grpc_server import start_grpc_server

        server = self.config.server
        api_key = server.api_key.get_secret_value() if server.api_key else None
        if api_key is None and not loopback(server.host):
            log.warning(
                "serving on %s with no API key (server.allow_unauthenticated): anyone who can "
                "reach its ports may use the model and cancel requests",
                server.host,
            )
        self.drain = Drain()
        # One grammar builder for both APIs, loading while the servers start.
        self.grammars = GrammarChecks(self.config.limits)
        if self.config.limits.grammar_builder_at_start:
            self.grammars.warm()
        tls = None
        if server.tls_cert is not None:
            tls = (Path(server.tls_cert).read_bytes(), Path(server.tls_key).read_bytes())
        self.grpc_server, grpc_port = await start_grpc_server(
            self.backend,
            server.host,
            server.grpc_port,
            self.config.limits,
            self.drain,
            tls,
            api_key,
            self.grammars,
        )
        self.metrics_server, metrics_port = start_metrics_server(
            self.metrics, server.host, server.metrics_port
        )
        http_port = None
        if server.http_port is not None:
            http_port = await self._start_http(server.host, server.http_port, api_key)
        self._poller = asyncio.create_task(self._poll_forever())
        self.watchdog = watch_loop("router")  # a stalled loop would hang every request silently
        freeze_startup_heap("router")
        return {"grpc_port": grpc_port, "metrics_port": metrics_port, "http_port": http_port}

    async def _start_http(self, host: str, port: int, api_key: str | None) -> int:
        from halfmoon.cluster.frontend.http_server import OpenAIServer, start_http_server

        model = await self.backend.model_info()
        api = OpenAIServer(
            self.backend,
            self.tokenizer,
            model,
            self.metrics.registry,
            api_key,
            self.config.limits,
            self.drain,
            self.grammars,
        )
        server = self.config.server
        tls = None if server.tls_cert is None else (server.tls_cert, server.tls_key)
        self.http_server, bound_port = await start_http_server(
            api.app, host, port, server.http_limits, tls
        )
        return bound_port

    async def add_worker(
        self, name: str, kind: str, handle, store_name: str | None, kv_peer: KvPeer | None = None
    ) -> None:
        client = worker_client(kind, handle)
        info = await client.info()
        worker = Worker(name, kind, client, info, store_name, kv_peer)
        self.backend.add_worker(worker, await client.snapshot())
        address = await client.serve_metrics(self.config.server.host)
        self.targets.add(name, address, {"role": kind, "worker": name})

    async def remove_worker(self, name: str) -> None:
        worker = self.backend.remove_worker(name)
        self.targets.remove(name)
        if worker is not None:
            self.metrics.remove_worker(name, worker.kind)

    async def loop_gap_s(self) -> float:
        """The longest its event loop went between two watchdog beats since the last call
        (`LoopWatchdog.take_max_gap_s`): what any one request's work stalled every other."""
        return self.watchdog.take_max_gap_s()

    async def set_draining(self, name: str, draining: bool) -> None:
        self.backend.set_draining(name, draining)

    async def add_store(self, name: str, handle) -> None:
        store = StoreClient(handle)
        self.backend.add_store(name, store, await store.snapshot())
        address = await store.serve_metrics(self.config.server.host)
        self.targets.add(name, address, {"role": "store", "store_node": name})

    async def remove_store(self, name: str) -> None:
        """Forget a store node that died (its blocks leave the prefix index at once)."""
        self.backend.remove_store(name)
        self.metrics.remove_store(name)
        self.targets.remove(name)

    async def metrics_targets(self) -> list[dict]:
        """The file_sd target groups of every worker's and store node's own /metrics."""
        return [self.targets.groups[name] for name in sorted(self.targets.groups)]

    async def in_flight(self, name: str | None = None) -> int:
        """Requests the router has in flight on worker `name` (to drain before removal); with
        None, all of them."""
        return self.backend.in_flight_on(name)

    async def ping(self) -> str:
        """The controller's liveness check (answered from the event loop every request uses)."""
        return "router"

    async def node_id(self) -> str:
        """The Ray node the router runs on (the node `halfmoon serve` ran on)."""
        return ray.get_runtime_context().get_node_id()

    async def timeline(self, request_id: str) -> list[tuple[str, float]]:
        """(stage, seconds since arrival) of a recent request, as `explain` shows them."""
        return self.backend.timeline(request_id)

    async def summaries(self, request_ids: list[str]) -> list[dict]:
        """Placement, predicted and measured TTFT and cache use of recent requests."""
        return self.backend.summaries(request_ids)

    async def stop(self) -> tuple[int, int]:
        """Drain (up to server.drain_timeout_s), then stop; returns the requests in flight
        when draining began and those the drain timeout cut."""
        in_flight = cut = 0
        if self.drain is not None:
            in_flight = self.drain.active
            cut = await self.drain.drain(self.config.server.drain_timeout_s)
        if self._poller is not None:
            self._poller.cancel()
        if self.http_server is not None:
            await self.http_server.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=2)
        if self.grammars is not None:
            await self.grammars.close()
        await self.backend.wait_released(RELEASE_AT_STOP_S)  # cut streams give back their pages
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        return in_flight, cut

    async def pool_signals(self, window_s: float = TRAFFIC_WINDOW_S) -> dict[str, dict[str, float]]:
        """Per pool, the autoscaling signals (per replica) and the traffic of the last
        `window_s` seconds (at most MAX_TRAFFIC_WINDOW_S)."""
        now = time.monotonic()
        traffic = self.requests.traffic(window_s, now)
        return {kind: {**traffic, **self.backend.pool_signals(kind, now)} for kind in POOLS}

    async def profile(self) -> Profile:
        """The Conductor's profile as refitted online from the live workers' timings."""
        return self.backend.profile()

    async def observed_steps(self) -> list[StepTiming]:
        """Every worker engine step polled since start (the last OBSERVED_STEPS of them)."""
        return list(self.steps_observed)

    async def calibrate(self, num_requests: int = 5, num_tokens: int = 48) -> float:
        """Measure the per-request overhead outside prefill compute by sending short requests
        through the whole pipeline; it goes into the Conductor's profile. Returns it."""
        return await calibrate(self.backend, num_requests, num_tokens)

    async def update_pool(self, pool: str, desired: int, actual: int) -> None:
        self.metrics.update_pool(pool, desired, actual)

    def _observe(self, trace: RequestTrace) -> None:
        self.requests.observe(trace, time.monotonic())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll_once()
            except Exception:  # noqa: BLE001 - reporting must never stop serving
                log.exception("polling workers and stores failed")
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_once(self) -> None:
        report: PollReport = await self.backend.poll()
        self.steps_observed.extend(report.steps)
        for num_bytes, seconds in report.transfers:
            self.metrics.record_transfer("store", num_bytes, seconds)
        for load in report.loads:
            self.metrics.update_worker(load)
        for name, stats in report.store_stats.items():
            self.metrics.update_store(name, stats)
