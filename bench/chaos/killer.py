"""The killer of `halfmoon bench chaos`: SIGKILLs one serving worker every few seconds, pools in
turn, and runs the controller that replaces the dead, in one thread (so it never reads the
cluster while a replacement is being registered)."""

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
PID_TIMEOUT_S = 30.0
PROC = Path("/proc")


class ChaosError(RuntimeError):
    """A worker reported a pid that is not its own actor process: nothing is killed."""


@dataclass(slots=True)
class Kill:
    """One SIGKILL: which worker, when (seconds since the chaos run began), how long it was
    held for its pool's last replacement, the requests the router had in flight on the worker,
    and how long until its pool was whole again (None if the run ended first)."""

    pool: str
    worker: str
    pid: int
    at_s: float
    held_s: float
    in_flight: int
    restored_s: float | None = None


def worker_pid(worker: WorkerHandle) -> int | None:
    """The pid of `worker`'s actor process, checked to be that process: never this process nor
    one of its ancestors, and (where /proc shows it) titled `ray::` + the worker's class, so
    never Ray's GCS or raylet. None if the process is gone already."""
    pid = ray.get(worker.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=PID_TIMEOUT_S)
    if pid <= 1 or pid == os.getpid() or pid in _ancestors():
        raise ChaosError(f"{worker.name} reported pid {pid}, which is not a worker of its own")
    if not PROC.exists():
        return pid
    try:
        title = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    expected = f"ray::{WORKER_CLASSES[worker.kind].__name__}"
    if not title.startswith(expected):
        raise ChaosError(f"pid {pid} of {worker.name} runs {title!r}, not {expected}")
    return pid


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
    (replacing dead workers, routing to their replacements once they answer) and, every
    `every_s` seconds, a SIGKILL to the serving worker with the most requests in flight, the
    pools in turn. A pool that is not whole (its last victim's replacement not yet routed to)
    is waited for: a worker is killed only once it serves."""

    def __init__(self, cluster: Cluster, every_s: float, seed: int) -> None:
        self.cluster = cluster
        self.every_s = every_s
        self.controller = Controller(cluster)
        self.rng = random.Random(seed)  # breaks ties between equally busy workers
        self.kills: list[Kill] = []
        self.killed: set[str] = set()
        self.held_since_s: float | None = None  # a due kill waiting for its pool's replacement
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
                self.controller.check_health()
                self.controller.autoscale()
                now_s = time.monotonic() - self.started_s
                self._note_restored(now_s)
                if now_s >= due_s and self._kill_one(POOLS[turn % 2], now_s):
                    due_s, turn = self.kills[-1].at_s + self.every_s, turn + 1
        except BaseException as error:  # noqa: BLE001 - reported by the bench, not lost
            self.error = error

    def _note_restored(self, now_s: float) -> None:
        for kill in self.kills:
            if kill.restored_s is None and self._whole(kill.pool):
                kill.restored_s = now_s - kill.at_s

    def _whole(self, pool: str) -> bool:
        return len(self.serving(pool)) >= getattr(self.cluster.config, pool).replicas

    def serving(self, pool: str) -> list[WorkerHandle]:
        """`pool`'s workers the router routes to and that were not killed."""
        skip = self.killed | set(self.controller.pending)
        return [
            w for w in list(self.cluster.workers.values()) if w.kind == pool and w.name not in skip
        ]

    def _kill_one(self, pool: str, now_s: float) -> bool:
        """SIGKILL `pool`'s busiest serving worker if the pool is whole; whether it did."""
        if not self._whole(pool):
            if self.held_since_s is None:
                self.held_since_s = now_s
            return False
        victim, in_flight = self._busiest(pool)
        try:
            pid = worker_pid(victim)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        except (RayActorError, GetTimeoutError, ProcessLookupError):
            pid = None
        if pid is None:
            return False  # died or stalled on its own: the controller sees to it
        at_s = time.monotonic() - self.started_s
        held_s = 0.0 if self.held_since_s is None else now_s - self.held_since_s
        self.held_since_s = None
        self.killed.add(victim.name)
        self.kills.append(Kill(pool, victim.name, pid, at_s, held_s, in_flight))
        print(
            f"  {at_s:7.1f} s  SIGKILL {victim.name} (pid {pid}, {in_flight} requests in flight)",
            file=sys.stderr,
        )
        return True

    def _busiest(self, pool: str) -> tuple[WorkerHandle, int]:
        """The serving worker of `pool` with the most requests in flight, and their number."""
        workers = self.serving(pool)
        router = self.cluster.router
        counts = ray.get([router.in_flight.remote(w.name) for w in workers], timeout=PID_TIMEOUT_S)
        ranked = sorted(zip(counts, workers, strict=True), key=lambda p: (-p[0], self.rng.random()))
        count, victim = ranked[0]
        return victim, count
