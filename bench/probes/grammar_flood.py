"""`halfmoon bench hostile-grammars`: the 50 hostile structured-output specs of
`hostile_grammars.py` sent to a live cluster over HTTP, then over gRPC, while small requests
run alongside; beside it the same small requests alone (the baseline).

Reported: how long each hostile request took to be answered (refused or served) and the worst,
the router's event-loop stall (its `LoopWatchdog`'s longest gap between two beats less the
beat interval), the small requests' median and p99 latency alone and alongside and their
ratio, and whether the router still serves after all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import ray
from tqdm import tqdm

from halfmoon.bench.device import bench_model, live_bench_settings
from halfmoon.bench.options import bench_parser
from halfmoon.bench.probes.hostile_grammars import grpc_constraints, http_bodies
from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.engine.loop_watchdog import BEAT_S
from halfmoon.engine.structured_output import StructuredOutput

SMALL = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
TIMEOUT_S = 60.0


@dataclass
class Answer:
    """One hostile request: which spec, over which API, what came back and how fast."""

    name: str
    api: str
    answer: str  # an HTTP status or a gRPC code ("200" / "OK": it was served)
    seconds: float


@dataclass
class Flood:
    answers: list[Answer] = field(default_factory=list)
    small_alone_s: list[float] = field(default_factory=list)
    small_alongside_s: list[float] = field(default_factory=list)
    stall_alone_ms: float = 0.0
    stall_flood_ms: float = 0.0
    alive: bool = False

    def summary(self) -> dict:
        worst = max(self.answers, key=lambda a: a.seconds)
        alone, alongside = _percentiles(self.small_alone_s), _percentiles(self.small_alongside_s)
        return {
            "hostile": len(self.answers),
            "served": sum(a.answer in ("200", "OK") for a in self.answers),
            "worst_s": round(worst.seconds, 3),
            "worst": worst.name,
            "stall_alone_ms": round(self.stall_alone_ms, 1),
            "stall_flood_ms": round(self.stall_flood_ms, 1),
            "small_alone_ms": alone,
            "small_alongside_ms": alongside,
            "small_p50_ratio": round(alongside["p50"] / alone["p50"], 2),
            "alive": self.alive,
            "answers": [vars(a) | {"seconds": round(a.seconds, 3)} for a in self.answers],
        }


def run(cluster: Cluster, api_key: str | None = None, small: int = 20, progress=True) -> Flood:
    """Send the baseline and the flood to a started `cluster` (its router actor gives the loop
    stall)."""
    base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
    grpc_address = f"127.0.0.1:{cluster.ports['grpc_port']}"
    with Client(grpc_address, api_key=api_key) as client:
        model = client.model_info(timeout=TIMEOUT_S).model
    flood = Flood()
    # Warm: a plain and a constrained request (the grammar builder loads in the background at
    # start, a worker's xgrammar at its first constrained request; a flood measures the server
    # they leave).
    warm = {**SMALL, "model": model}
    _post(base_url, api_key, "/completions", json.dumps(warm).encode())
    _post(base_url, api_key, "/completions", json.dumps({**warm, "guided_choice": ["a"]}).encode())
    ray.get(cluster.router.loop_gap_s.remote())  # start the stall measurement over
    for _ in range(small):
        flood.small_alone_s.append(_small(base_url, api_key, model))
    flood.stall_alone_ms = _stall_ms(cluster)
    stop = threading.Event()

    def alongside() -> None:
        while not stop.is_set():
            flood.small_alongside_s.append(_small(base_url, api_key, model))

    runner = threading.Thread(target=alongside, daemon=True)
    runner.start()
    bodies, constraints = http_bodies(model), grpc_constraints()
    bar = tqdm(total=len(bodies) + len(constraints), desc="hostile", disable=not progress)
    for name, _, body in bodies:
        started = time.monotonic()
        status = _post(base_url, api_key, "/chat/completions", body)
        flood.answers.append(Answer(name, "http", str(status), time.monotonic() - started))
        bar.update()
    with Client(grpc_address, api_key=api_key) as client:
        for name, kind, spec in constraints:
            started = time.monotonic()
            code = _generate(client, StructuredOutput(kind, spec))
            flood.answers.append(Answer(name, "grpc", code, time.monotonic() - started))
            bar.update()
        bar.close()
        stop.set()
        runner.join()
        flood.stall_flood_ms = _stall_ms(cluster)
        flood.alive = client.complete(SMALL["prompt"], max_tokens=2).finish_reason == "length"
    return flood


def _stall_ms(cluster: Cluster) -> float:
    return max(0.0, ray.get(cluster.router.loop_gap_s.remote()) - BEAT_S) * 1000


def _small(base_url: str, api_key: str | None, model: str) -> float:
    started = time.monotonic()
    status = _post(
        base_url, api_key, "/completions", json.dumps({**SMALL, "model": model}).encode()
    )
    if status != 200:
        raise RuntimeError(f"a small completion got HTTP {status}")
    return time.monotonic() - started


def _post(base_url: str, api_key: str | None, path: str, body: bytes) -> int:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(base_url + path, body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


def _generate(client: Client, structured: StructuredOutput) -> str:
    try:
        client.complete("hi", max_tokens=4, structured_output=structured, timeout=TIMEOUT_S)
    except ServerError as error:
        return error.code
    return "OK"


def _percentiles(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered) * 1000, 1), "p99": round(p99 * 1000, 1)}


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(
        "hostile-grammars",
        progress=True,
        description="Start a colocated cluster of the bench model on CPU, send it 50 hostile "
        "structured-output specs over HTTP and 48 over gRPC (long bounds, nested counted "
        "repetitions, deep nesting, huge enums, catastrophic regexes) while small completions "
        "run alongside, and the same small completions alone as the baseline.",
        epilog="Output (--json keys): hostile (requests sent), served, worst_s and worst (the "
        "slowest answer and its spec), stall_alone_ms and stall_flood_ms (the router loop's "
        "longest stall), small_alone_ms and small_alongside_ms (p50, p99), small_p50_ratio "
        "(alongside over alone), alive, answers (each spec: api, answer, seconds).",
    )
    parser.add_argument("--model", help="checkpoint directory (default: the ~50M bench model)")
    parser.add_argument(
        "--small", type=int, default=20, help="small completions in the baseline (%(default)s)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = live_bench_settings(
        bench_model("cpu", args.model), "cpu", mode="colocated", **{"server.http_port": 0}
    )
    cluster = Cluster(load_config(None, settings))
    try:
        cluster.start()
        flood = run(cluster, small=args.small, progress=not args.disable_tqdm)
    finally:
        cluster.stop()
    summary = flood.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{'':24} {'alone':>10} {'alongside':>10} {'ratio':>6}")
    alone, alongside = summary["small_alone_ms"], summary["small_alongside_ms"]
    ratio = summary["small_p50_ratio"]
    print(f"{'small p50 (ms)':24} {alone['p50']:>10} {alongside['p50']:>10} {ratio:>6}")
    print(f"{'small p99 (ms)':24} {alone['p99']:>10} {alongside['p99']:>10}")
    print(f"{'loop stall (ms)':24} {summary['stall_alone_ms']:>10} {summary['stall_flood_ms']:>10}")
    print(
        f"hostile: {summary['hostile']} sent, {summary['served']} served, the slowest answered "
        f"in {summary['worst_s']} s ({summary['worst']}); router alive: {summary['alive']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
