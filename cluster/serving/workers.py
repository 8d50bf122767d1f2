"""The workers and store nodes the router knows, which of them may take requests, and the
Conductor's instances kept in step with that (a dead or draining worker is routed around)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ray.exceptions import RayActorError, RayTaskError

from halfmoon.cluster.serving.clients import DecodeClient, PrefillClient, StoreClient
from halfmoon.cluster.worker.info import WorkerInfo, WorkerLoad
from halfmoon.engine.llm_engine import StepTiming
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.router.conductor import Conductor
from halfmoon.router.reports import BlockEvents, DecodeLoad, EngineStep, PrefillLoad

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Worker:
    name: str
    kind: str
    client: PrefillClient | DecodeClient
    info: WorkerInfo  # what it told the router of itself: its degree, its KV pages
    store_name: str | None = None
    kv_peer: KvPeer | None = None  # a decode worker's socket for prefill workers' notices
    draining: bool = False
    dead: bool = False  # a call to it failed: no new requests until it answers again
    load: WorkerLoad | None = None  # its last load report


@dataclass(slots=True)
class PollReport:
    """What one poll of every worker and store node found, for the metrics."""

    loads: list[WorkerLoad] = field(default_factory=list)
    steps: list[StepTiming] = field(default_factory=list)
    transfers: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    store_stats: dict[str, dict] = field(default_factory=dict)


class WorkerPool:
    """Workers by name and store nodes by name; feeds the Conductor their reports."""

    def __init__(self, conductor: Conductor, mode: str) -> None:
        self.conductor = conductor
        self.mode = mode
        self.workers: dict[str, Worker] = {}
        self.stores: dict[str, StoreClient] = {}

    def get(self, name: str) -> Worker | None:
        return self.workers.get(name)

    def worker(self, name: str) -> Worker:
        """The worker the Conductor placed a request on (it knows only live ones)."""
        return self.workers[name]

    def add_store(self, name: str, store: StoreClient, blocks: Sequence[BlockEvent] = ()) -> None:
        """Read store node `name`; `blocks`: what its tiers hold already (its snapshot)."""
        self.stores[name] = store
        self.conductor.observe(BlockEvents(blocks))

    def remove_store(self, name: str) -> None:
        """Stop reading store node `name` and forget every block the index had there."""
        self.stores.pop(name, None)
        self.conductor.remove_instance(name)

    def add(self, worker: Worker, blocks: Sequence[BlockEvent] = ()) -> None:
        """Route to `worker`; `blocks`: what its pages hold already (its snapshot)."""
        self.workers[worker.name] = worker
        self._route_to(worker)
        if worker.kind == "prefill" or self.mode == "colocated":  # as `_poll_worker` reads
            self.conductor.observe(BlockEvents(blocks))

    def remove(self, name: str) -> Worker | None:
        """Forget worker `name`; returns it (None if unknown)."""
        self.conductor.remove_instance(name)
        return self.workers.pop(name, None)

    def _route_to(self, worker: Worker) -> None:
        """Register the worker with the Conductor at its degree, a decode worker with its own
        KV pages; colocated, each worker is both a prefill and a decode instance (it prefills
        what it decodes)."""
        info = worker.info
        if worker.kind == "prefill" or self.mode == "colocated":
            degree, node = info.tensor_parallel_size, worker.store_name
            self.conductor.add_instance(
                worker.name, "prefill", node=node, tensor_parallel_size=degree
            )
        if worker.kind == "decode":
            capacity = info.num_pages * info.block_size
            degree = info.tensor_parallel_size
            self.conductor.add_instance(
                worker.name, "decode", tensor_parallel_size=degree, capacity_tokens=capacity
            )

    def set_draining(self, name: str, draining: bool) -> None:
        """A draining worker gets no new requests; the ones it has finish."""
        worker = self.workers[name]
        worker.draining = draining
        if draining:
            self.conductor.remove_instance(name)
        elif not worker.dead:
            self._route_to(worker)

    def mark_dead(self, name: str) -> None:
        """Route no more requests to `name` (its call failed) until it answers again."""
        worker = self.workers.get(name)
        if worker is None or worker.dead:
            return
        worker.dead = True
        self.conductor.remove_instance(name)
        log.warning("routing around worker %s until it answers or is replaced", name)

    def mark_alive(self, name: str) -> None:
        """A worker marked dead answered a call: route to it again."""
        worker = self.workers.get(name)
        if worker is not None and worker.dead:
            worker.dead = False
            if not worker.draining:
                self._route_to(worker)

    def alive(self, kind: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.kind == kind and not (w.draining or w.dead)]

    def pool_kinds(self) -> tuple[str, ...]:
        """The pools a request needs: decode alone when colocated."""
        return ("decode",) if self.mode == "colocated" else ("prefill", "decode")

    def missing_pool(self) -> str | None:
        return next((kind for kind in self.pool_kinds() if not self.alive(kind)), None)

    def health(self) -> tuple[bool, str]:
        counts = {kind: len(self.alive(kind)) for kind in self.pool_kinds()}
        missing = [kind for kind, count in counts.items() if count == 0]
        live = ", ".join(f"{count} {kind}" for kind, count in counts.items())
        if missing:
            return False, f"no live {' or '.join(missing)} worker ({live})"
        return True, f"serving ({live})"

    def store_of(self, name: str) -> str:
        """The store node worker `name` publishes to (its own name if it is not a worker)."""
        worker = self.workers.get(name)
        return worker.store_name if worker is not None else name

    def signals(self, kind: str, now: float) -> dict[str, float]:
        """Per replica of the `kind` pool: waiting tokens, running requests, pages used,
        predicted prefill queue seconds; and the worst predicted decode TBT."""
        names = [w for w in self.workers.values() if w.kind == kind and not w.draining]
        loads = [w.load for w in names if w.load is not None]
        per = max(len(names), 1)
        queue_s, tbt_s = self.conductor.view().pool_load(now)
        return {
            "waiting_tokens": sum(load.num_waiting_tokens for load in loads) / per,
            "running_requests": sum(load.num_running for load in loads) / per,
            "pages_used_ratio": sum(load.pages_used_ratio for load in loads) / per,
            "queue_s": queue_s / per,
            "predicted_tbt_s": tbt_s,
        }

    async def poll(self) -> PollReport:
        """Ask every worker and store node for its load, steps and block events; the Conductor
        learns of them, and a worker that fails the call is routed around."""
        report = PollReport()
        for worker in list(self.workers.values()):
            try:
                await self._poll_worker(worker, report)
            except RayActorError as error:
                if not isinstance(error, RayTaskError):
                    self.mark_dead(worker.name)
        for name, store in self.stores.items():
            try:
                events, stats = await store.report()
                self.conductor.observe(BlockEvents(events))
                report.store_stats[name] = dataclasses.asdict(stats)
            except RayActorError:
                continue
        return report

    async def _poll_worker(self, worker: Worker, report: PollReport) -> None:
        polled = await worker.client.report()
        load, steps, events = polled.load, polled.steps, polled.events
        for step in steps:
            self.conductor.observe(EngineStep(step, worker.info.tensor_parallel_size))
        report.steps += steps
        # A decode worker's pages are a prefix cache only where it prefills (colocated).
        if worker.kind == "prefill" or self.mode == "colocated":
            self.conductor.observe(BlockEvents(events))
        report.transfers += polled.transfers
        self.mark_alive(worker.name)
        worker.load = load
        report.loads.append(load)
        if worker.kind == "decode":
            self.conductor.observe(DecodeLoad(worker.name, load.num_running, load.num_kv_tokens))
        if worker.kind == "prefill":
            num_requests = load.num_running + load.num_waiting
            as_of = time.monotonic() - load.age_s
            tokens_left = load.num_waiting_tokens
            self.conductor.observe(PrefillLoad(worker.name, num_requests, tokens_left, as_of))

    async def loads_info(self) -> dict[str, dict]:
        """Each worker's load as `server_info` shows it."""
        loads = {}
        for worker in self.workers.values():
            try:
                load = await worker.client.load()
            except RayActorError:
                loads[worker.name] = {"kind": worker.kind, "dead": True}
                continue
            loads[worker.name] = {
                "kind": worker.kind,
                "tensor_parallel_size": worker.info.tensor_parallel_size,
                "kernels": worker.info.kernels,
                "kv_transfer": worker.info.kv_transfer,
                "draining": worker.draining,
                "running": load.num_running,
                "waiting": load.num_waiting,
                "pages_used_ratio": round(load.pages_used_ratio, 4),
            }
            reserved = self.conductor.view().reserved_kv_tokens(worker.name)
            if reserved is not None:  # what the router holds back for requests placed there
                loads[worker.name]["reserved_kv_tokens"] = reserved
        return loads

    async def stores_info(self) -> dict[str, dict]:
        """Each store node's host and Redis tiers as `server_info` shows them."""
        stores = {}
        for name, store in self.stores.items():
            try:
                stats = await store.stats()
                stores[name] = {
                    tier: dataclasses.asdict(getattr(stats, tier)) for tier in ("host", "redis")
                }
            except RayActorError:
                stores[name] = {"dead": True}
        return stores
