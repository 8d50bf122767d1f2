"""`halfmoon serve`: start the cluster, keep it healthy, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from halfmoon.cluster.config import ClusterConfig
from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.control.launcher import Cluster

log = logging.getLogger(__name__)


def serve(config: ClusterConfig) -> int:
    """Run until a signal arrives; every actor and process started here is stopped after."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()
    cluster = Cluster(config)
    try:
        ports = cluster.start()
        # After ray.init, which installs a SIGTERM handler of its own.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        host = config.server.host
        workers = ", ".join(f"{w.name}" for w in cluster.workers.values())
        print(f"halfmoon serving {cluster.info.model} ({config.mode}: {workers})", flush=True)
        print(
            f'  gRPC     {host}:{ports["grpc_port"]}   try: halfmoon generate "Hello" '
            f"--server {host}:{ports['grpc_port']}",
            flush=True,
        )
        if ports.get("http_port") is not None:
            print(
                f"  OpenAI   http://{host}:{ports['http_port']}/v1   try: curl "
                f"http://{host}:{ports['http_port']}/v1/models",
                flush=True,
            )
        print(f"  metrics  http://{host}:{ports['metrics_port']}/metrics", flush=True)
        print("  Ctrl-C stops it.", flush=True)
        Controller(cluster).run(stop)
    except KeyboardInterrupt:  # Ctrl-C before the handlers above were set: while starting
        print("halfmoon: interrupted while starting", file=sys.stderr, flush=True)
        return 130
    finally:
        drain_s = config.server.drain_timeout_s
        print(
            f"halfmoon: shutting down (in-flight requests get up to {drain_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        cluster.stop()
    return 0
