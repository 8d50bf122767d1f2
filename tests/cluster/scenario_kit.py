"""Scenarios that need Ray nodes of their own (ray.cluster_utils) run in a process of their
own (a pytest process holds one Ray instance only) and write what they saw as JSON. Beside
the boot and the report, the kit holds the fetch plan the multinode and the engine scenarios
both run: a prefix served on one prefill node, then fetched from its store by the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster as RayCluster

from halfmoon.bench.serve_nodes import wait_stores_gone
from halfmoon.cluster.client.grpc_client import Client
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster

GiB = 1 << 30
# One small Ray node of a scenario's cluster (the machine has 2 cores); no log monitor (a
# process a node, tailing logs for drivers that do not print them: log_to_driver is off).
NODE = {
    "num_cpus": 1,
    "memory": 2 * GiB,
    "object_store_memory": 100 * 1024 * 1024,
    "include_log_monitor": False,
}
# The head, as a node with no dashboard (as everywhere else in the suite: its processes cost CPU).
HEAD = {**NODE, "include_dashboard": False}
# A raylet starved of CPU on a loaded 2-core machine answers its health checks late: give it
# 30 s a check and 10 checks before the GCS takes its node for dead (Ray's defaults, 10 s and
# 5, lost a live spare node in CI). A killed raylet still fails every check at once (connection
# refused), so a removed node is marked dead within 10 periods: of 0.5 s, not Ray's 3 s (a
# check starts a period after the last one ended, so the period adds nothing to a live one's 30 s).
SCENARIO_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_health_check_timeout_ms": "30000",
    "RAY_health_check_failure_threshold": "10",
    "RAY_health_check_period_ms": "500",
}
# How long a scenario waits for its nodes to be registered (Ray's default is 30 s).
NODES_TIMEOUT_S = 180
# The fetch plan's prompts: a long shared prefix, two questions.
FETCH_PREFIX = "The long system prompt that every request of this tenant starts with. " * 40
FETCH_QUESTIONS = ["What comes first?", "And what comes next?"]
FETCH_MAX_TOKENS = 6


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
    resource, every prompt through a prefill worker, no Redis, the shipped CPU profile (fetching
    FETCH_PREFIX beats computing it; no profile measured at start) and no grammar builder at
    start (cluster_kit's reasons)."""
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
        "router.profile": "cpu-tiny",
        "limits.grammar_builder_at_start": False,
        **more,
    }


@contextmanager
def connected(nodes: RayCluster) -> Iterator[None]:
    """This process connected to the Ray nodes `nodes`; after, the nodes shut down."""
    ray.init(address=nodes.address, namespace="halfmoon", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        nodes.shutdown()


@contextmanager
def started(settings: dict) -> Iterator[tuple[Cluster, dict]]:
    """halfmoon with `settings` on the connected nodes, and its ports; after, stopped and its
    store nodes gone (the next cluster's take the same names)."""
    cluster = Cluster(load_config(None, settings))
    try:
        yield cluster, cluster.start()
    finally:
        cluster.stop()
        wait_stores_gone(cluster)


def kv_block_bytes(worker) -> int:
    """Bytes of one block's K and V over every layer, from a worker's `info`."""
    return ray.get(worker.info.remote()).kv_layout.block_bytes


def write_report(path: str, report: dict) -> None:
    with open(path, "w") as file:
        json.dump(report, file)


def serve_fetched(cluster: Cluster, client: Client) -> dict:
    """The fetch plan: FETCH_PREFIX with the first question on one prefill worker; that worker
    drains and the second goes to the other one, which holds none of the prefix, so the
    Conductor plans a fetch from the first one's store. The drained worker serves again after."""
    prompts = [FETCH_PREFIX + question for question in FETCH_QUESTIONS]
    stored = stored_blocks(client)
    outputs = [complete(client, prompts[0], "first")]
    (first,) = summaries(cluster, ["first"])
    holder = first["prefill_instance"]
    wait_stored(client, stored)
    ray.get(cluster.router.set_draining.remote(holder, True))
    outputs.append(complete(client, prompts[1], "second"))
    ray.get(cluster.router.set_draining.remote(holder, False))
    (second,) = summaries(cluster, ["second"])
    prefills = [(name, w) for name, w in cluster.workers.items() if w.kind == "prefill"]
    return {
        "outputs": outputs,
        "first": first,
        "second": second,
        "explain": client.explain("second"),
        "stores": {name: ray.get(w.actor.store_name.remote()) for name, w in prefills},
    }


def complete(client: Client, prompt: str, request_id: str) -> list[int]:
    out = client.complete(
        prompt, max_tokens=FETCH_MAX_TOKENS, temperature=0.0, ignore_eos=True, request_id=request_id
    )
    return out.token_ids


def summaries(cluster: Cluster, request_ids: list[str]) -> list[dict]:
    return ray.get(cluster.router.summaries.remote(request_ids))


def stored_blocks(client: Client) -> int:
    """Blocks in every store's host tier, as the router last polled them."""
    stores = client.server_info().details["stores"]
    return sum(figures.get("host", {}).get("blocks", 0) for figures in stores.values())


def wait_stored(client: Client, before: int, timeout_s: float = 30.0) -> None:
    """Until the router has heard of more stored blocks than `before` (it polls the stores'
    events)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stored_blocks(client) > before:
            time.sleep(1.0)  # one more poll of the router: the events follow the stats
            return
        time.sleep(0.2)
    raise TimeoutError("the store never reported the first prompt's blocks")
