"""The killer of `halfmoon bench chaos`: SIGKILLs one part every few seconds, the kinds in turn
(a prefill worker, a decode worker, a store node, the local Redis, the router), and runs the
controller that replaces the dead, in one thread (so it never reads the cluster while a
replacement is being registered)."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.control.launcher import WORKER_CLASSES, Cluster, WorkerHandle

POOLS = ("prefill", "decode")
KINDS = (*POOLS, "store", "redis", "router")
PID_TIMEOUT_S = 30.0
ANSWER_S = 2.0  # a store node or router that answers within this is whole again
PROC = Path("/proc")


class ChaosError(RuntimeError):
    """A part reported a pid that is not its own process: nothing is killed."""


@dataclass(slots=True)
class Kill:
    """One SIGKILL: which kind of part and which one, when (seconds since the chaos run began),
    how long it was held for that kind's last replacement, the requests in flight it hit (on
    the worker for a worker; on the router, all of them, for the others), and how long until
    that kind was whole again (None if the run ended first)."""

    kind: str
    target: str
    pid: int
    at_s: float
    held_s: float
    in_flight: int
    restored_s: float | None = None


def process_pid(pid: int, title: str) -> int | None:
    """`pid`, checked to be a process of the part: never this process nor one of its ancestors,
    and (where /proc shows it) its program's name starting with `title`, so never Ray's GCS or
    raylet. None if the process is gone already."""
    if pid <= 1 or pid == os.getpid() or pid in _ancestors():
        raise ChaosError(f"pid {pid} is not a part of the cluster's own")
    if not PROC.exists():
        return pid
    try:
        cmdline = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    if not os.path.basename(cmdline.split(" ", 1)[0]).startswith(title):
        raise ChaosError(f"pid {pid} runs {cmdline!r}, not {title}")
    return pid


def actor_pid(actor, class_name: str) -> int | None:
    """The pid of an actor's process (titled `ray::` + its class), checked as `process_pid`."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=PID_TIMEOUT_S)
    return process_pid(pid, f"ray::{class_name}")


def worker_pid(worker: WorkerHandle) -> int | None:
    return actor_pid(worker.actor, WORKER_CLASSES[worker.kind].__name__)


def _ancestors() -> set[int]:
    pids, pid = set(), os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = _parent(pid)
    return pids


def _parent(pid: int) -> int:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


class Killer:
    """Beside the requests, in one thread: a controller round every `health.interval_s`
    (replacing a dead router, store node, Redis or worker, routing to new workers once they
    answer) and, every `every_s` seconds, a SIGKILL to one part of the next of `kinds` (a
    pool's serving worker with the most requests in flight). A kind that is not whole (its
    last victim's replacement not yet serving) is waited for."""

    def __init__(self, cluster: Cluster, every_s: float, seed: int, kinds=KINDS) -> None:
        self.cluster = cluster
        self.every_s = every_s
        self.kinds = tuple(kinds)
        self.controller = Controller(cluster)
        self.rng = random.Random(seed)  # breaks ties between equally busy workers
        self.kills: list[Kill] = []
        self.killed: set[str] = set()
        self.held_since_s: float | None = None  # a due kill waiting for its kind's replacement
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)

    def start(self) -> None:
        self.started_s = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        due_s, turn = self.every_s, 0
        interval_s = self.cluster.config.health.interval_s
        try:
            while not self._stop.wait(interval_s):
                self.controller.check_router()
                self.controller.check_health()
                self.controller.autoscale()
                now_s = time.monotonic() - self.started_s
                self._note_restored(now_s)
                kind = self.kinds[turn % len(self.kinds)]
                if now_s >= due_s and self._kill_one(kind, now_s):
                    due_s, turn = self.kills[-1].at_s + self.every_s, turn + 1
        except BaseException as error:  # noqa: BLE001 - reported by the bench, not lost
            self.error = error

    def _note_restored(self, now_s: float) -> None:
        for kill in self.kills:
            if kill.restored_s is None and self._whole(kill.kind):
                kill.restored_s = now_s - kill.at_s

    def _whole(self, kind: str) -> bool:
        if kind in POOLS:
            return len(self.serving(kind)) >= getattr(self.cluster.config, kind).replicas
        if kind == "redis":
            redis = self.cluster.store_setup.redis
            return redis is not None and redis.poll() is None
        actors = [self.cluster.router] if kind == "router" else list(self.cluster.stores.values())
        try:
            ray.get([actor.ping.remote() for actor in actors], timeout=ANSWER_S)
        except (RayActorError, GetTimeoutError):
            return False
        return True

    def serving(self, pool: str) -> list[WorkerHandle]:
        """`pool`'s workers the router routes to and that were not killed."""
        skip = self.killed | set(self.controller.pending)
        return [
            w for w in list(self.cluster.workers.values()) if w.kind == pool and w.name not in skip
        ]

    def _kill_one(self, kind: str, now_s: float) -> bool:
        """SIGKILL a part of `kind` if that kind is whole; whether it did."""
        if not self._whole(kind):
            if self.held_since_s is None:
                self.held_since_s = now_s
            return False
        try:
            target, pid, in_flight = self._victim(kind)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        except (RayActorError, GetTimeoutError, ProcessLookupError):
            pid = None
        if pid is None:
            return False  # died or stalled on its own: the controller sees to it
        at_s = time.monotonic() - self.started_s
        held_s = 0.0 if self.held_since_s is None else now_s - self.held_since_s
        self.held_since_s = None
        if kind in POOLS:
            self.killed.add(target)
        self.kills.append(Kill(kind, target, pid, at_s, held_s, in_flight))
        print(
            f"  {at_s:7.1f} s  SIGKILL {target} (pid {pid}, {in_flight} requests in flight)",
            file=sys.stderr,
        )
        return True

    def _victim(self, kind: str) -> tuple[str, int | None, int]:
        """(name, pid, requests in flight it hits) of the part of `kind` to kill."""
        if kind in POOLS:
            worker, in_flight = self._busiest(kind)
            return worker.name, worker_pid(worker), in_flight
        in_flight = ray.get(self.cluster.router.in_flight.remote(), timeout=PID_TIMEOUT_S)
        if kind == "router":
            return "router", actor_pid(self.cluster.router, "RouterActor"), in_flight
        if kind == "store":
            node_id = self.rng.choice(sorted(self.cluster.stores))
            pid = actor_pid(self.cluster.stores[node_id], "StoreNode")
            return f"store {node_id[:8]}", pid, in_flight
        return "redis", process_pid(self.cluster.store_setup.redis.pid, "redis-server"), in_flight

    def _busiest(self, pool: str) -> tuple[WorkerHandle, int]:
        """The serving worker of `pool` with the most requests in flight, and their number."""
        workers = self.serving(pool)
        counts = self._counts(workers)
        ranked = sorted(zip(counts, workers, strict=True), key=lambda p: (-p[0], self.rng.random()))
        count, victim = ranked[0]
        return victim, count

    def _counts(self, workers: list[WorkerHandle]) -> list[int]:
        router = self.cluster.router
        return ray.get([router.in_flight.remote(w.name) for w in workers], timeout=PID_TIMEOUT_S)
