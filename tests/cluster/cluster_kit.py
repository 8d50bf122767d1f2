"""Helpers to run a real cluster (Ray actors, store, gRPC server) inside the test session."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator

import ray
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.cluster.client.grpc_client import Client
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster


@contextlib.contextmanager
def running_cluster(model_dir, **overrides) -> Iterator[tuple[Cluster, Client]]:
    """A started cluster on free ports and a client connected to it; stopped on exit."""
    settings = {
        "model": str(model_dir),
        "server.grpc_port": 0,
        "server.metrics_port": 0,
        "server.http_port": 0,
        "engine.num_pages": 128,
        "engine.prefill_chunk_size": 32,
        "engine.max_num_batched_tokens": 128,
        "prefill.num_cpus": 0.5,
        "decode.num_cpus": 0.5,
        "store.use_local_redis": False,
        # The shipped CPU profile instead of measuring one at start (saves ~3 s a cluster);
        # tests of the measured profile pass `router.profile: None`.
        "router.profile": "cpu-tiny",
        # The grammar builder starts with the first constrained request (not ~1.5 s of CPU in
        # every cluster); tests of structured outputs at start set it.
        "limits.grammar_builder_at_start": False,
        **overrides,
    }
    cluster = Cluster(load_config(None, settings))
    try:
        ports = cluster.start()
        with Client(f"127.0.0.1:{ports['grpc_port']}") as client:
            yield cluster, client
    finally:
        cluster.stop()


def worker(cluster: Cluster, name: str):
    return cluster.workers[name].actor


def counters(cluster: Cluster, name: str) -> dict:
    return ray.get(worker(cluster, name).counters.remote())


def wait_until(condition, timeout_s: float = 20.0) -> None:
    """Poll a condition the cluster reaches asynchronously (a release after a cancel, an abort
    after a disconnect)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def kv_transfer_bytes(metrics_port: int) -> float:
    """The router's halfmoon_kv_transfer_bytes_total, over every path."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "halfmoon_kv_transfer_bytes_total"
    )
