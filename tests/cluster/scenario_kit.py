"""Scenarios that need Ray nodes of their own (ray.cluster_utils) run in a process of their
own (a pytest process holds one Ray instance only) and write what they saw as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster as RayCluster

from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster

GiB = 1 << 30
# One small Ray node of a scenario's cluster (the machine has 2 cores).
NODE = {"num_cpus": 1, "memory": 2 * GiB, "object_store_memory": 100 * 1024 * 1024}
# A raylet starved of CPU on a loaded 2-core machine answers its health checks late: give it
# 30 s a check and 10 checks before the GCS takes its node for dead (Ray's defaults, 10 s and
# 5, lost a live spare node in CI). A killed raylet still fails every check at once (connection
# refused), so a removed node is marked dead within 10 periods of 3 s.
SCENARIO_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_health_check_timeout_ms": "30000",
    "RAY_health_check_failure_threshold": "10",
}
# How long a scenario waits for its nodes to be registered (Ray's default is 30 s).
NODES_TIMEOUT_S = 180


def run_scenario(script: Path, model_dir, out_dir: Path, timeout_s: float, *args: str) -> dict:
    """Run `script MODEL OUT.json [ARGS]` and return what it wrote (its output when it
    fails)."""
    out = out_dir / "report.json"
    env = {**os.environ, **SCENARIO_ENV}
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return json.loads(out.read_text())


def pool_settings(model: str, **more) -> dict:
    """A scenario cluster's settings: 256 pages a worker, each pool on the nodes that carry its
    resource, every prompt through a prefill worker, no Redis."""
    return {
        "model": model,
        "engine.num_pages": 256,
        "server.grpc_port": 0,
        "server.http_port": 0,  # scenarios of other test processes may run at the same time
        "server.metrics_port": 0,
        "prefill.num_cpus": 1,
        "prefill.resources": {"prefill": 1},
        "decode.num_cpus": 1,
        "decode.resources": {"decode": 1},
        "store.use_local_redis": False,
        "store.host_memory_fraction": 0.25,
        "router.bypass_threshold_tokens": 0,  # every prompt goes through prefill -> decode
        **more,
    }


@contextmanager
def started(nodes: RayCluster, settings: dict) -> Iterator[tuple[Cluster, dict]]:
    """halfmoon with `settings` on the Ray nodes `nodes`, and its ports; after, everything
    stopped, the nodes too."""
    ray.init(address=nodes.address, namespace="halfmoon", log_to_driver=False)
    cluster = Cluster(load_config(None, settings))
    try:
        yield cluster, cluster.start()
    finally:
        cluster.stop()
        ray.shutdown()
        nodes.shutdown()


def kv_block_bytes(worker) -> int:
    """Bytes of one block's K and V over every layer, from a worker's `info`."""
    return ray.get(worker.info.remote()).kv_layout.block_bytes


def write_report(path: str, report: dict) -> None:
    with open(path, "w") as file:
        json.dump(report, file)
