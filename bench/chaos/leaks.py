"""What a cluster still holds for requests (pages, running or queued requests, receives, store
leases): all zero once every request has ended, whatever killed what on the way."""

from __future__ import annotations

import time

import ray

from halfmoon.cluster.control.launcher import Cluster

CALL_TIMEOUT_S = 10.0


def held(cluster: Cluster) -> dict[str, int]:
    """Per worker its used pages, requests and receives, per store node its leased blocks; a
    part that does not answer (dead, being replaced) is left out."""
    found = {}
    for name, worker in list(cluster.workers.items()):
        try:
            stats = ray.get(worker.actor.counters.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            continue
        found[f"{name} pages"] = stats["num_used_pages"]
        found[f"{name} requests"] = stats["num_running"] + stats["num_waiting"]
        found[f"{name} receives"] = stats.get("num_receiving", 0)
    for node_id, store in list(cluster.stores.items()):
        try:
            stats = ray.get(store.stats.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            continue
        found[f"store {node_id[:8]} leases"] = stats.host.leased_blocks
    return found


def wait_released(cluster: Cluster, timeout_s: float) -> tuple[dict[str, int], float]:
    """Until nothing is held or `timeout_s` passed: what is still held (empty: nothing) and how
    long it took."""
    began = time.monotonic()
    while True:
        left = {part: count for part, count in held(cluster).items() if count}
        waited_s = time.monotonic() - began
        if not left or waited_s > timeout_s:
            return left, waited_s
        time.sleep(0.2)
