"""The router actor: hosts the gRPC frontend, the OpenAI HTTP API and /metrics, routes with the
Conductor, and keeps the Conductor's views and prefix index fed from worker and store reports."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import statistics
import time
from collections import deque
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from halfmoon.cluster.config import ClusterConfig, router_config, served_name
from halfmoon.cluster.control.metrics_targets import MetricsTargets
from halfmoon.cluster.serving.backend import GenerateInput
from halfmoon.cluster.serving.cluster_backend import ClusterBackend, RequestTrace, Worker
from halfmoon.engine.llm_engine import StepTiming
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.tokenizer import load_tokenizer
from halfmoon.engine.worker_info import WorkerInfo, WorkerLoad
from halfmoon.kvstore.kv_notices import KvPeer
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.router.conductor import Conductor
from halfmoon.router.profile import Profile

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.25
# Engine steps kept for `observed_steps` (a replay fits its live profile from them).
OBSERVED_STEPS = 50_000
TRAFFIC_WINDOW_S = 60.0
RELEASE_AT_STOP_S = 5.0


class RouterActor:
    """One per cluster: the frontend clients talk to and the Conductor that places requests."""

    def __init__(self, config: ClusterConfig) -> None:
        # Created before the workers answer, so this process starts (and imports) while they
        # load the model; `setup` gives it what it needs from them.
        from halfmoon.cluster.control.metrics import Metrics

        self.config = config
        self.metrics = Metrics()
        self.backend: ClusterBackend | None = None
        self.loads: dict[str, WorkerLoad] = {}
        self.finished: deque[tuple[float, int, int, int]] = deque()  # (time, in, out, cached)
        self.steps_observed: deque[StepTiming] = deque(maxlen=OBSERVED_STEPS)
        self.grpc_server = None
        self.http_server = None
        self.drain = None
        self.metrics_server = None
        self.targets = MetricsTargets(config.server.metrics_targets_file)
        self._poller: asyncio.Task | None = None

    async def setup(self, info: WorkerInfo, profile: Profile) -> None:
        """The model's facts (from a worker) and the cost profile: the Conductor and the backend."""
        config = self.config
        conductor = Conductor(router_config(config, info.block_size), profile)
        tokenizer = load_tokenizer(Path(info.model))
        bound = None if config.router.admission == "none" else config.router.max_queued_per_worker
        self.backend = ClusterBackend(
            tokenizer, info, conductor, config.mode, self._observe, served_name(config), bound,
            pool_wait_s=config.router.pool_wait_s,
        )  # fmt: skip

    async def start(self) -> dict:
        """Start the gRPC API, the OpenAI HTTP API and /metrics; returns the bound ports
        (`http_port` None when the HTTP API is off)."""
        from halfmoon.cluster.control.metrics import start_metrics_server
        from halfmoon.cluster.frontend.drain import Drain
        from halfmoon.cluster.frontend.grpc_server import start_grpc_server

        server = self.config.server
        api_key = server.api_key.get_secret_value() if server.api_key else None
        self.drain = Drain()
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
        )
        self.metrics_server, metrics_port = start_metrics_server(
            self.metrics, server.host, server.metrics_port
        )
        http_port = None
        if server.http_port is not None:
            http_port = await self._start_http(server.host, server.http_port, api_key)
        self._poller = asyncio.create_task(self._poll_forever())
        freeze_startup_heap("router")
        return {"grpc_port": grpc_port, "metrics_port": metrics_port, "http_port": http_port}

    async def _start_http(self, host: str, port: int, api_key: str | None) -> int:
        from halfmoon.cluster.frontend.http_server import OpenAIServer, start_http_server

        model = await self.backend.model_info()
        api = OpenAIServer(
            self.backend,
            self.backend.tokenizer,
            model,
            self.metrics.registry,
            api_key,
            self.config.limits,
            self.drain,
        )
        self.http_server, bound_port = await start_http_server(api.app, host, port)
        return bound_port

    async def add_worker(
        self, name: str, kind: str, handle, store_name: str | None, kv_peer: KvPeer | None = None
    ) -> None:
        self.backend.add_worker(Worker(name, kind, handle, store_name, kv_peer))
        address = await handle.serve_metrics.remote(self.config.server.host)
        self.targets.add(name, address, {"role": kind, "worker": name})

    async def remove_worker(self, name: str) -> None:
        worker = self.backend.workers.get(name)
        self.backend.remove_worker(name)
        self.targets.remove(name)
        self.loads.pop(name, None)
        if worker is not None:
            self.metrics.remove_worker(name, worker.kind)

    async def set_draining(self, name: str, draining: bool) -> None:
        self.backend.set_draining(name, draining)

    async def add_store(self, name: str, handle) -> None:
        self.backend.stores[name] = handle
        address = await handle.serve_metrics.remote(self.config.server.host)
        self.targets.add(name, address, {"role": "store", "store_node": name})

    async def remove_store(self, name: str) -> None:
        """Forget a store node whose Ray node is gone."""
        self.backend.stores.pop(name, None)
        self.metrics.remove_store(name)
        self.targets.remove(name)

    async def metrics_targets(self) -> list[dict]:
        """The file_sd target groups of every worker's and store node's own /metrics."""
        return [self.targets.groups[name] for name in sorted(self.targets.groups)]

    async def in_flight(self, name: str) -> int:
        """Requests the router has in flight on worker `name` (to drain before removal)."""
        return sum(
            1
            for lease in self.backend.leases.values()
            if name in (w.name for w in lease.attempt.workers())
        )

    async def node_id(self) -> str:
        """The Ray node the router runs on (the node `halfmoon serve` ran on)."""
        return ray.get_runtime_context().get_node_id()

    async def status(self) -> dict:
        return await self.backend.server_info()

    async def explain(self, request_id: str) -> str:
        return await self.backend.explain(request_id)

    async def timeline(self, request_id: str) -> list[tuple[str, float]]:
        """(stage, seconds since arrival) of a recent request, as `explain` shows them."""
        return self.backend.timeline(request_id)

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
        await self.backend.wait_released(RELEASE_AT_STOP_S)  # cut streams give back their pages
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        return in_flight, cut

    async def pool_signals(self) -> dict[str, dict[str, float]]:
        """Per pool, the autoscaling signals (per replica) and the recent traffic."""
        now = time.monotonic()
        while self.finished and self.finished[0][0] < now - TRAFFIC_WINDOW_S:
            self.finished.popleft()
        n = len(self.finished)
        traffic = {
            "request_rate_per_s": n / TRAFFIC_WINDOW_S,
            "mean_input_tokens": sum(f[1] for f in self.finished) / n if n else 0.0,
            "mean_output_tokens": sum(f[2] for f in self.finished) / n if n else 0.0,
            "mean_cached_tokens": sum(f[3] for f in self.finished) / n if n else 0.0,
        }
        conductor = self.backend.conductor
        signals = {}
        for kind in ("prefill", "decode"):
            names = [
                w.name for w in self.backend.workers.values() if w.kind == kind and not w.draining
            ]
            loads = [self.loads[name] for name in names if name in self.loads]
            waiting = sum(load.num_waiting_tokens for load in loads)
            running = sum(load.num_running for load in loads)
            pages = sum(load.pages_used_ratio for load in loads)
            per = max(len(names), 1)
            signals[kind] = {
                **traffic,
                "waiting_tokens": waiting / per,
                "running_requests": running / per,
                "pages_used_ratio": pages / per,
                "queue_s": sum(v.wait_s(now) for v in conductor.prefill.values()) / per,
                "predicted_tbt_s": max(
                    (conductor.predictor.tbt_now(v, 0) for v in conductor.decode.values()),
                    default=0.0,
                ),
            }
        return signals

    async def profile(self) -> Profile:
        """The Conductor's profile as refitted online from the live workers' timings."""
        return self.backend.conductor.profile

    async def observed_steps(self) -> list[StepTiming]:
        """Every worker engine step polled since start (the last OBSERVED_STEPS of them)."""
        return list(self.steps_observed)

    async def calibrate(self, num_requests: int = 5, num_tokens: int = 48) -> float:
        """Measure the per-request overhead outside prefill compute by sending short requests
        through the whole pipeline; it goes into the Conductor's profile. Returns it."""
        conductor = self.backend.conductor
        rng = random.Random(0)
        overheads = []
        traces: list[RequestTrace] = []
        observer, self.backend.observer = self.backend.observer, traces.append  # not client traffic
        try:
            for i in range(num_requests):
                vocab = self.backend.info.vocab_size
                prompt = [rng.randrange(6, vocab) for _ in range(num_tokens)]
                request = GenerateInput(f"calibrate-{i}", prompt, SamplingParams(max_tokens=1))
                async for _ in self.backend.generate(request):
                    pass
                trace = traces[-1]
                compute_s = trace.prefill_compute_s
                if compute_s is None:  # prefilled on the decode worker: no split, use the model
                    compute_s = conductor.profile.cost.prefill_time(num_tokens, 0)
                overheads.append(trace.first_token_s - trace.arrived_s - compute_s)
        finally:
            self.backend.observer = observer
        overhead_s = max(0.0, statistics.median(overheads))
        conductor.set_request_overhead(overhead_s)
        return overhead_s

    async def update_pool(self, pool: str, desired: int, actual: int) -> None:
        self.metrics.update_pool(pool, desired, actual)

    def _observe(self, trace: RequestTrace) -> None:
        """Record one ended request in the metrics."""
        metrics, now = self.metrics, time.monotonic()
        if trace.outcome == "finished":
            self.finished.append(
                (now, trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)
            )
        metrics.record_outcome(trace.outcome, trace.reason)
        metrics.prompt_tokens.inc(trace.num_prompt_tokens)
        metrics.generated_tokens.inc(trace.num_output_tokens)
        metrics.cached_tokens.inc(trace.num_cached_tokens)
        if trace.num_prompt_tokens:
            local = trace.num_cached_tokens - trace.num_loaded_tokens
            metrics.record_prefix_lookup("device", trace.num_prompt_tokens, local)
            if trace.prefill_instance is not None:
                store_queried = trace.num_prompt_tokens - local
                metrics.record_prefix_lookup("store", store_queried, trace.num_loaded_tokens)
        if trace.prefill_started_s is not None:
            metrics.queue_seconds.observe(trace.prefill_started_s - trace.arrived_s)
        if trace.first_token_s is None:
            return
        ttft_s = trace.first_token_s - trace.arrived_s
        metrics.ttft_seconds.observe(ttft_s)
        if trace.predicted_ttft_s is not None:
            metrics.record_ttft_prediction(trace.predicted_ttft_s, ttft_s)
        if trace.num_output_tokens > 1:
            gap_s = (trace.last_token_s - trace.first_token_s) / (trace.num_output_tokens - 1)
            metrics.inter_token_seconds.observe(gap_s)
        if trace.outcome == "finished":
            metrics.e2e_seconds.observe(now - trace.arrived_s)
        slo = self.config.slo
        if slo.ttft_s is not None:
            metrics.record_slo("ttft", ttft_s <= slo.ttft_s)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll_once()
            except Exception:  # noqa: BLE001 - reporting must never stop serving
                log.exception("polling workers and stores failed")
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_once(self) -> None:
        conductor = self.backend.conductor
        for worker in list(self.backend.workers.values()):
            try:
                load = await worker.handle.load.remote()
                for step in await worker.handle.drain_steps.remote():
                    conductor.observe_step(step)
                    self.steps_observed.append(step)
                if worker.kind == "prefill":
                    for event in await worker.handle.drain_events.remote():
                        conductor.index.apply(event)
                else:
                    for num_bytes, seconds in await worker.handle.drain_transfers.remote():
                        self.metrics.record_transfer("store", num_bytes, seconds)
            except RayActorError as error:
                if not isinstance(error, RayTaskError):
                    self.backend.mark_dead(worker.name)
                continue
            self.backend.mark_alive(worker.name)
            self.loads[worker.name] = load
            self.metrics.update_worker(load)
            if worker.kind == "decode" and worker.name in conductor.decode:
                conductor.report_decode(worker.name, load.num_running, load.num_kv_tokens)
        for name, store in self.backend.stores.items():
            try:
                for event in await store.drain_events.remote():
                    conductor.index.apply(event)
                self.metrics.update_store(name, dataclasses.asdict(await store.stats.remote()))
            except RayActorError:
                continue
