"""One actor's own /metrics (a worker's or a store node's): its process CPU and memory plus
what only it measures. Prometheus finds these endpoints in the file_sd targets file the router
writes (`server.metrics_targets_file`)."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

import ray
from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from halfmoon.kvstore.process_gc import gc_pause_histogram

ANY_ADDRESS = ("0.0.0.0", "::", "")
# No `*_created` series beside every counter and histogram: Prometheus would keep each as a
# series of its own, and nothing of ours reads them.
disable_created_metrics()


def actor_registry() -> CollectorRegistry:
    """A registry holding this process's CPU, memory and file-descriptor figures (`process_*`)
    and its garbage-collection pauses (`halfmoon_gc_pause_seconds`)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    registry.register(gc_pause_histogram())
    return registry


def serve_actor_metrics(registry: CollectorRegistry, host: str) -> tuple[WSGIServer, str]:
    """Serve `registry` at /metrics on a free port of `host`; returns the server and the
    host:port Prometheus scrapes (this node's IP when bound to every address)."""
    server, _thread = start_http_server(0, addr=host, registry=registry)
    address = ray.util.get_node_ip_address() if host in ANY_ADDRESS else host
    return server, f"{address}:{server.server_address[1]}"
