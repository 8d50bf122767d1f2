"""The controller: restarts dead workers (and, through recovery.py, a dead router or store node)
and resizes the pools by their autoscaling policies."""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from halfmoon.cluster.control.autoscaling import Autoscaler
from halfmoon.cluster.control.autoscaling_policy import AutoscalingError
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.cluster.control.recovery import Recovery, Silence, answered_within
from halfmoon.cluster.serving.router_actor import TRAFFIC_WINDOW_S
from halfmoon.router.cost_model import CostModel

log = logging.getLogger(__name__)


class Controller:
    """Runs beside the cluster in the process that started it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.num_restarts = 0
        self.restarts_by_kind: dict[str, int] = {}
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
        self.silence = Silence(cluster.config.health.unresponsive_s)
        self.recovery = Recovery(cluster, self.silence)

    @property
    def silent_since(self) -> dict[str, float]:
        """Parts whose last pings timed out: since when."""
        return self.silence.since

    def check_router(self) -> bool:
        """Replace the router if it died or hangs (recovery.py); whether it was replaced."""
        routed = [name for name in self.cluster.workers if name not in self.pending]
        return self.recovery.check_router(routed)

    def check_health(self) -> list[str]:
        """Ping every worker and store node; replace each one that is dead, failed (a worker's
        ping raises: e.g. a tensor-parallel rank died), or silent for longer than
        `health.unresponsive_s`. Returns the replaced workers' names."""
        self.register_started()
        workers = [w for w in self.cluster.workers.values() if w.name not in self.pending]
        timeout_s = self.cluster.config.health.timeout_s
        refs = {worker.name: worker.actor.ping.remote() for worker in workers}
        answered = answered_within(refs.values(), timeout_s)
        dead = []
        for worker in workers:
            if refs[worker.name] not in answered:
                if self.silence.too_long(worker.name):
                    dead.append(worker)
                continue
            try:
                ray.get(refs[worker.name])
                self.silence.answered(worker.name)
            except RayActorError:
                dead.append(worker)
            except RayTaskError as error:  # alive, but its engine cannot step (a rank died)
                log.warning("worker %s failed its health check: %s", worker.name, error.cause)
                dead.append(worker)
        for worker in dead:
            self.silence.answered(worker.name)
            log.warning("worker %s is dead or unresponsive; replacing it", worker.name)
            self.draining.discard(worker.name)
            self.cluster.remove_worker(worker.name)
            replacement = self.start_worker(worker.kind)
            self.num_restarts += 1
            self.restarts_by_kind[worker.kind] = self.restarts_by_kind.get(worker.kind, 0) + 1
            log.warning("worker %s replaced by %s", worker.name, replacement)
        self.recovery.check_stores()
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
        """One round: observe each pool, apply the decisions, retire drained workers. A round
        the router does not answer within `health.timeout_s` is logged and skipped."""
        try:
            self._autoscale(time.monotonic() if now is None else now)
        except (RayActorError, GetTimeoutError) as error:
            log.warning("autoscaling round skipped: the router did not answer (%s)", error)

    def _autoscale(self, now: float) -> None:
        self._retire_drained()
        self.register_started()
        if self.autoscaler is None:
            return
        signals, cost = self._observations()
        for pool in self.cluster.pools:
            if getattr(self.cluster.config.autoscaling, pool) is not None:
                self._scale(pool, now, signals[pool], cost)

    def _observations(self) -> tuple[dict[str, dict[str, float]], CostModel | None]:
        """The pools' signals and, when a planner needs it, the workers' cost model as the
        router has it now (measured at start, calibrated, refit online), never a stale copy."""
        router = self.cluster.router
        windows = {pool: self._window_s(pool) for pool in self.cluster.pools}
        asked = {w: router.pool_signals.remote(w) for w in set(windows.values())}
        profile = router.profile.remote() if self.autoscaler.needs_cost_model else None
        answers = {w: self._ask(ref) for w, ref in asked.items()}
        signals = {pool: answers[w][pool] for pool, w in windows.items()}
        return signals, None if profile is None else self._ask(profile).cost

    def _window_s(self, pool: str) -> float:
        """Seconds of traffic pool `pool`'s policy averages over (a planner's `window_s`)."""
        policy = getattr(self.cluster.config.autoscaling, pool)
        return getattr(policy, "window_s", TRAFFIC_WINDOW_S)

    def _scale(
        self, pool: str, now: float, signals: dict[str, float], cost: CostModel | None
    ) -> None:
        """Observe `pool`, decide its size and start or drain workers to reach it."""
        current = len(self.active(pool))
        try:
            self.autoscaler.observe(pool, now, signals, cost)
        except AutoscalingError as error:
            log.warning("autoscaling %s skipped this round: %s", pool, error)
            return
        decision = self.autoscaler.decide(pool, now, current)
        desired, reason = decision.desired, decision.reason
        self._ask(self.cluster.router.update_pool.remote(pool, desired, current))
        if desired != current:
            log.info("autoscaling %s: %d -> %d (%s)", pool, current, desired, reason)
            self.history.append((now, pool, current, desired, reason))
        self._resize(pool, current, desired)

    def _resize(self, pool: str, current: int, desired: int) -> None:
        """Start workers up to `desired`, or shed the excess: pending ones first, then drain."""
        for _ in range(desired - current):
            self.start_worker(pool)
        excess = current - desired
        excess -= len(self._cancel_pending(pool, excess))
        for name in self._pick_to_drain(pool, excess):
            self._ask(self.cluster.router.set_draining.remote(name, True))
            self.draining.add(name)

    def active(self, pool: str) -> list[str]:
        """Workers of `pool` that take new requests."""
        return [
            w.name
            for w in self.cluster.workers.values()
            if w.kind == pool and w.name not in self.draining
        ]

    def run(self, stop: threading.Event) -> None:
        """Check the router's and the workers' health and autoscale every `health.interval_s`
        until `stop` is set."""
        interval = self.cluster.config.health.interval_s
        while not stop.wait(interval):
            try:
                self.check_router()
                self.check_health()
                self.autoscale()
            except Exception:  # noqa: BLE001 - the controller must outlive one bad round
                log.exception("controller round failed")

    def _ask(self, ref: ray.ObjectRef):
        """The router's answer to one call, waiting at most `health.timeout_s`."""
        return ray.get(ref, timeout=self.cluster.config.health.timeout_s)

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
            if self._ask(router.in_flight.remote(name)) == 0:
                self.cluster.remove_worker(name)
                self.draining.discard(name)
                log.info("drained and removed worker %s", name)
