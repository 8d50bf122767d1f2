"""The controller: restarts dead workers and resizes the pools by their autoscaling policies."""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from halfmoon.cluster.control.autoscaling import Autoscaler
from halfmoon.cluster.control.launcher import Cluster

log = logging.getLogger(__name__)


class Controller:
    """Runs beside the cluster in the process that started it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.num_restarts = 0
        policies = cluster.config.autoscaling
        self.autoscaler = (
            Autoscaler.from_config(cluster.config)
            if (policies.prefill or policies.decode)
            else None
        )
        self.draining: set[str] = set()
        # Started workers not yet answering (Ray may be booting a node for them): name -> ping.
        self.pending: dict[str, ray.ObjectRef] = {}
        self.history: list[tuple[float, str, int, int, str]] = []  # (t, pool, actual, desired, why)

    def check_health(self) -> list[str]:
        """Ping every worker; replace each one that is dead or silent. Returns the dead names."""
        self.register_started()
        workers = [w for w in self.cluster.workers.values() if w.name not in self.pending]
        timeout_s = self.cluster.config.health.timeout_s
        refs = {worker.name: worker.actor.ping.remote() for worker in workers}
        dead = []
        for worker in workers:
            try:
                ray.get(refs[worker.name], timeout=timeout_s)
            except (RayActorError, GetTimeoutError):
                dead.append(worker)
        for worker in dead:
            log.warning("worker %s is dead or silent; replacing it", worker.name)
            self.draining.discard(worker.name)
            self.cluster.remove_worker(worker.name)
            replacement = self.start_worker(worker.kind)
            self.num_restarts += 1
            log.warning("worker %s replaced by %s", worker.name, replacement)
        self.cluster.ensure_stores()
        return [worker.name for worker in dead]

    def start_worker(self, kind: str) -> str:
        """Start a worker of `kind` without waiting for Ray to place it; `register_started`
        routes to it once it answers. Returns its name."""
        worker = self.cluster.add_worker(kind, wait=False)
        self.pending[worker.name] = worker.actor.ping.remote()
        return worker.name

    def register_started(self) -> list[str]:
        """Route to every started worker that answers now; never waits for one that does not
        (its node may still be booting, or no node has its resources yet). Returns their names."""
        refs = list(self.pending.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        registered = []
        for name, ref in list(self.pending.items()):
            if ref not in ready:
                continue
            del self.pending[name]
            try:
                ray.get(ref)
            except RayActorError:
                # E.g. placed on a node that died before Ray noticed: start another elsewhere.
                kind = self.cluster.workers[name].kind
                self.cluster.forget_worker(name)
                log.error(
                    "worker %s died before it answered; started %s", name, self.start_worker(kind)
                )
                continue
            self.cluster.register_worker(self.cluster.workers[name])
            registered.append(name)
        return registered

    def autoscale(self, now: float | None = None) -> None:
        """One round: observe each pool, apply the decisions, retire drained workers."""
        self._retire_drained()
        self.register_started()
        if self.autoscaler is None:
            return
        now = time.monotonic() if now is None else now
        router = self.cluster.router
        signals = ray.get(router.pool_signals.remote())
        for pool in self.cluster.pools:
            if getattr(self.cluster.config.autoscaling, pool) is None:
                continue
            active = self.active(pool)
            self.autoscaler.observe(pool, now, signals[pool])
            decision = self.autoscaler.decide(pool, now, len(active))
            ray.get(router.update_pool.remote(pool, decision.desired, len(active)))
            if decision.desired != len(active):
                log.info(
                    "autoscaling %s: %d -> %d (%s)",
                    pool,
                    len(active),
                    decision.desired,
                    decision.reason,
                )
                self.history.append((now, pool, len(active), decision.desired, decision.reason))
            for _ in range(decision.desired - len(active)):
                self.start_worker(pool)
            excess = len(active) - decision.desired
            excess -= len(self._cancel_pending(pool, excess))
            for name in self._pick_to_drain(pool, excess):
                ray.get(router.set_draining.remote(name, True))
                self.draining.add(name)

    def active(self, pool: str) -> list[str]:
        """Workers of `pool` that take new requests."""
        return [
            w.name for w in self.cluster.workers.values()
            if w.kind == pool and w.name not in self.draining
        ]  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        """Check health and autoscale every `health.interval_s` until `stop` is set."""
        interval = self.cluster.config.health.interval_s
        while not stop.wait(interval):
            try:
                self.check_health()
                self.autoscale()
            except Exception:  # noqa: BLE001 - the controller must outlive one bad round
                log.exception("controller round failed")

    def _cancel_pending(self, pool: str, count: int) -> list[str]:
        """Stop up to `count` of `pool`'s workers still waiting for a node, newest first: a
        shrinking pool loses those before it drains a serving one."""
        names = [name for name in self.active(pool)[::-1] if name in self.pending][: max(count, 0)]
        for name in names:
            del self.pending[name]
            self.cluster.forget_worker(name)
        return names

    def _pick_to_drain(self, pool: str, count: int) -> list[str]:
        # The newest workers go first: the oldest hold the warmest prefix caches.
        ready = [name for name in self.active(pool) if name not in self.pending]
        return ready[::-1][: max(count, 0)]

    def _retire_drained(self) -> None:
        """Remove draining workers once nothing of theirs is in flight."""
        router = self.cluster.router
        for name in list(self.draining):
            if ray.get(router.in_flight.remote(name)) == 0:
                self.cluster.remove_worker(name)
                self.draining.discard(name)
                log.info("drained and removed worker %s", name)
