"""What every worker actor has: its engine behind a step thread, and the calls the router and
controller make on any worker (info, load, ping, profile, counters)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import sys

import ray
import torch

from halfmoon.cluster.worker.info import (
    WorkerInfo,
    WorkerLoad,
    WorkerReport,
    worker_info,
    worker_load,
)
from halfmoon.cluster.worker.metrics import WorkerMetrics
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.loop_watchdog import LoopWatchdog, watch_loop
from halfmoon.engine.openmp_pool import release_thread_pool
from halfmoon.engine.profiling import ProfileSamples, profile_engine
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.kvstore.metrics_endpoint import serve_actor_metrics
from halfmoon.kvstore.process_gc import freeze_startup_heap
from halfmoon.kvstore.transfer.plan import TransferUnit, plan_transfer

# How long a thread of a worker holds the GIL while another waits for it (Python's default is
# 5 ms). The step thread gives the GIL up around every torch op and waits to take it back;
# while the event loop runs Python (streaming a step's tokens out, a receive, a poll), each
# wait lasted up to the whole interval: served 1+1 TPOT at 1 req/s 6 ms lower at 0.5 ms.
SWITCH_INTERVAL_S = 0.0005


class EngineWorker:
    """Base of the prefill and decode workers; `kind` names the pool."""

    kind = "worker"

    def __init__(self, name: str, engine: LLMEngine) -> None:
        self.name = name
        self.engine = engine
        use_assigned_cpus()
        hand_the_gil_over_sooner()
        config = engine.config  # the prefill chunk is the transfer unit on both sides
        self.chunk_tokens = config.prefill_chunk_size or config.max_num_batched_tokens
        self.async_engine: AsyncEngine | None = None
        self.watchdog: LoopWatchdog | None = None  # with the AsyncEngine, on the actor's loop
        self.metrics = WorkerMetrics()
        self.metrics_address: str | None = None
        self.device_blocks: set[bytes] = set()  # what its page events say its pages hold
        engine.record_page_events()  # the router's prefix index learns of this worker's pages
        freeze_startup_heap(f"{self.kind} worker {name}")
        release_thread_pool()  # the engine was built on this thread; it steps on its own

    def _engine(self) -> AsyncEngine:
        # Created on first use, inside the actor's event loop.
        if self.async_engine is None:
            self.async_engine = AsyncEngine(self.engine)
            self.watchdog = watch_loop(f"{self.kind} worker {self.name}")
        return self.async_engine

    async def info(self) -> WorkerInfo:
        return worker_info(self.name, self.kind, self.engine, self._kv_transfer())

    async def load(self) -> WorkerLoad:
        """As of the end of the engine's last step (never waiting for the one in progress)."""
        stats, age_s = self._engine().stats()
        return worker_load(self.name, self.kind, stats, age_s)

    async def profile(self, prefill: bool = True, decode: bool = True) -> ProfileSamples:
        """Time prefills and/or decode steps on this worker (a few seconds; run before
        serving)."""
        return await self._engine().run(lambda engine: profile_engine(engine, 0, prefill, decode))

    async def ping(self) -> str:
        """This worker's name; raises RankFailedError once a rank of its engine has died, or
        DeviceFailedError once a step left its device unusable (a sticky CUDA error), so the
        controller replaces it (the engine cannot step again)."""
        self.engine.check_ranks()
        self._engine().check()
        return self.name

    async def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    async def counters(self) -> dict:
        """Engine counters plus the worker's own (`_extra_counters`)."""
        stats, _ = self._engine().stats()
        own = {"num_gc_frozen": gc.get_freeze_count(), **self._extra_counters()}
        return {**dataclasses.asdict(stats), **own}

    async def report(self) -> WorkerReport:
        """Its load, and what happened since the last report: engine steps, blocks in and out
        of its own pages, KV receives (the router polls this every 250 ms)."""
        load = await self.load()
        steps = self._engine().take_steps()
        self.metrics.observe(steps)
        return WorkerReport(load, steps, self._take_page_events(), self._take_transfers())

    async def snapshot(self) -> list[BlockEvent]:
        """Every block its own pages hold now, as one `stored` event: where a new router's
        prefix index starts from (the reports after it say what changed)."""
        self._take_page_events()
        return [BlockEvent("stored", self.name, "device", sorted(self.device_blocks))]

    async def end_all(self) -> int:
        """End every request this worker holds, as `abort` does each (their router died, so
        nothing will claim their pages, reservations or streams); returns how many."""
        request_ids = self._held_request_ids() | set(await self._engine().run(_live_requests))
        for request_id in request_ids:
            await self.abort(request_id)
        return len(request_ids)

    async def store_replaced(self, name: str) -> None:
        """Store node `name` died and a new one runs under its name: find it on next use."""
        self._forget_store(name)

    def _held_request_ids(self) -> set[str]:
        """Requests the worker holds outside its engine (subclasses say which)."""
        return set()

    def _forget_store(self, name: str) -> None:
        """Drop every handle of store node `name` and its arena (subclasses say which)."""

    def _take_page_events(self) -> list[BlockEvent]:
        page_events = self._engine().take_page_events()
        for kind, key in page_events:
            if kind == "stored":
                self.device_blocks.add(key)
            else:
                self.device_blocks.discard(key)
        return [BlockEvent(kind, self.name, "device", [key]) for kind, key in page_events]

    def _take_transfers(self) -> list[tuple[int, float]]:
        return []

    async def serve_metrics(self, host: str) -> str:
        """Serve this worker's /metrics on a free port of `host` (once); returns host:port."""
        if self.metrics_address is None:
            self.metrics_server, self.metrics_address = serve_actor_metrics(
                self.metrics.registry, host
            )
        return self.metrics_address

    def _extra_counters(self) -> dict:
        return {}

    def _kv_transfer(self) -> str:
        """How this worker's KV crosses nodes (kvstore/transfer/engine.py); "": it does not."""
        return ""

    def _plan_transfer(
        self, request_id: str, token_ids: list[int], block_keys: list[bytes]
    ) -> list[TransferUnit]:
        """How the prompt's KV travels between the workers (kvstore/transfer/plan.py)."""
        facts = self.engine.facts
        chunk = self.chunk_tokens
        return plan_transfer(
            facts.root_key, block_keys, token_ids, facts.block_size, chunk, request_id
        )


def _live_requests(engine: LLMEngine) -> list[str]:
    return list(engine.requests)


def use_assigned_cpus() -> int | None:
    """One torch intra-op thread per whole CPU Ray gave this actor (at least one) and one
    inter-op thread, whatever OMP_NUM_THREADS the actor inherited; returns the thread count,
    None outside an actor (torch's defaults stay)."""
    if not _in_actor():
        return None
    resources = ray.get_runtime_context().get_assigned_resources()
    threads = max(1, math.floor(resources.get("CPU", 1.0)))
    torch.set_num_threads(threads)
    # Settable only before any inter-op work has run (and once); the engine starts none.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return threads


def hand_the_gil_over_sooner() -> float | None:
    """In an actor, Python's switch interval set to `SWITCH_INTERVAL_S`; returns it, None
    outside an actor (the interval stays)."""
    if not _in_actor():
        return None
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return SWITCH_INTERVAL_S


def _in_actor() -> bool:
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
