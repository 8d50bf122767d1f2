"""The controller: restarts dead workers and applies the autoscaling policies."""

from __future__ import annotations

import logging
import threading

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from halfmoon.cluster.launcher import Cluster

log = logging.getLogger(__name__)


class Controller:
    """Runs beside the cluster in the process that started it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.num_restarts = 0

    def check_health(self) -> list[str]:
        """Ping every worker; replace each one that is dead or silent. Returns the dead names."""
        workers = list(self.cluster.workers.values())
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
            self.cluster.remove_worker(worker.name)
            replacement = self.cluster.add_worker(worker.kind)
            self.num_restarts += 1
            log.warning("worker %s replaced by %s", worker.name, replacement.name)
        self.cluster.ensure_stores()
        return [worker.name for worker in dead]

    def run(self, stop: threading.Event) -> None:
        """Check health every `health.interval_s` until `stop` is set."""
        interval = self.cluster.config.health.interval_s
        while not stop.wait(interval):
            try:
                self.check_health()
            except Exception:  # noqa: BLE001 - the controller must outlive one bad round
                log.exception("health check failed")
