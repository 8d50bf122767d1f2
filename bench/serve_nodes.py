"""`halfmoon bench serve --across-nodes`: issue 48's served goal. One run makes three Ray nodes
on this machine with ray.cluster_utils.Cluster (a head for the router and this driver, a
`prefill` node, a `decode` node; every address 127.0.0.1) and serves the same requests, at the
same rate, from two halfmoon clusters in turn, each on the same model and settings:

- `split`: the prefill worker on the prefill node, the decode worker on the decode node; the KV
  crosses on Mooncake's Transfer Engine (`store.transfer.engine: mooncake`, over TCP on
  127.0.0.1), written layer by layer into the decode worker's staging memory.
- `one_node`: both workers on the decode node; the KV goes the one-node way (the prefill
  worker's direct notices, the decode worker copying out of its lent pages or the node's arena).

The load and its figures are `halfmoon bench serve`'s (bench/serve.py): TTFT and TPOT p50 and
p99 of both layouts side by side, the ratio split / one-node and the goal (TTFT p50 within
1.3x). Each worker's `kv_transfer` from the server's status shows the engine was there, and the
decode worker's counters over the run (engine receives, layers streamed as Ray objects, direct
receives, page copies) which path the KV took. Every node here shares this machine's cores:
the workers, the router and the raylets time-slice them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster as RayCluster

from halfmoon.bench.metrics import parse_percentiles, ratios, summarize
from halfmoon.bench.options import add_workload_options, bench_parser
from halfmoon.bench.serve import (
    bench_target,
    build_requests,
    load_vocabulary,
    report_main,
    run_config,
)
from halfmoon.bench.targets import BACKENDS, make_target

GiB = 1 << 30
HOST = "127.0.0.1"
GOAL = 1.3  # split TTFT p50 at most this many times the one-node figure
NODES_TIMEOUT_S = 180
NODE = {"memory": 2 * GiB, "object_store_memory": 100 << 20, "node_ip_address": HOST}
# Each layout: the custom resource its prefill and its decode worker take (the decode node
# carries both of its own, for the one-node layout's two workers).
LAYOUTS = {
    "split": ("bench_prefill", "bench_decode"),
    "one_node": ("bench_pair", "bench_pair"),
}
# Ray's health checks, as tests/cluster/scenario_kit.py gives them: a raylet starved of CPU on
# a loaded 2-core machine answers late.
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_health_check_timeout_ms": "30000",
    "RAY_health_check_failure_threshold": "10",
}
COUNTERS = {
    "decode": (
        "num_engine_receives",
        "num_streamed_layers",
        "num_direct_receives",
        "num_page_copies",
        "num_shared_reads",
    ),
    "prefill": ("num_engine_writes", "engine_bytes_written", "num_failed_engine_writes"),
}
FIGURES = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")


def settings(model: str, layout: str, staging_bytes: int, profile: str | None = None) -> dict:
    """A 1+1 cluster's settings with its workers where `layout` puts them; the router's
    `profile` (None: measured at start)."""
    prefill, decode = LAYOUTS[layout]
    return {
        "model": model,
        "server.grpc_port": 0,
        "server.metrics_port": 0,
        "server.http_port": 0,
        "prefill.num_cpus": 1,
        "prefill.resources": {prefill: 1},
        "decode.num_cpus": 1,
        "decode.resources": {decode: 1},
        "store.use_local_redis": False,
        "store.host_memory_fraction": 0.25,
        "store.transfer.engine": "mooncake",
        "store.transfer.host": HOST,  # the nodes are on this machine: loopback only
        "store.transfer.staging_bytes": staging_bytes,
        "router.bypass_threshold_tokens": 0,  # every prompt goes through prefill -> decode
        "router.profile": profile,
        "limits.grammar_builder_at_start": False,  # the load has no constrained requests
    }


def start_nodes() -> RayCluster:
    """The head (router, driver), the prefill node and the decode node."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    nodes = RayCluster(
        initialize_head=True,
        head_node_args={**NODE, "num_cpus": 1, "include_dashboard": False},
    )
    nodes.add_node(**NODE, num_cpus=1, resources={"bench_prefill": 1})
    nodes.add_node(**NODE, num_cpus=2, resources={"bench_decode": 1, "bench_pair": 2})
    nodes.wait_for_nodes(NODES_TIMEOUT_S)
    return nodes


def node_names() -> dict[str, str]:
    """Each live Ray node's id, named by the custom resource that marks it."""
    names = {}
    for node in ray.nodes():
        if node["Alive"]:
            marks = {"bench_prefill": "prefill node", "bench_decode": "decode node"}
            found = [name for res, name in marks.items() if res in node["Resources"]]
            names[node["NodeID"]] = found[0] if found else "head"
    return names


def worker_counters(cluster) -> dict[str, dict]:
    """Every worker's counters of COUNTERS (its kind's); {} for one that cannot be read."""
    out = {}
    for name, worker in cluster.workers.items():
        try:
            counters = ray.get(worker.actor.counters.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError):
            counters = {}
        out[name] = {key: counters[key] for key in COUNTERS[worker.kind] if key in counters}
    return out


def grown(before: dict, after: dict) -> dict:
    """What each worker's counters grew by over the run."""
    return {
        name: {key: value - before.get(name, {}).get(key, 0) for key, value in counts.items()}
        for name, counts in after.items()
    }


def kv_transfer(address: str) -> dict[str, str]:
    """Each worker's `kv_transfer` as `halfmoon status` reads it (the server's info)."""
    from halfmoon.cluster.client.grpc_client import Client

    with Client(address) as client:
        workers = client.server_info().details["workers"]
    return {name: load.get("kv_transfer", "") for name, load in sorted(workers.items())}


def serve_layout(layout: str, model: str, requests, vocabulary, tokenizer, args) -> dict:
    """Start halfmoon in `layout`, send the load, read its status and counters, stop it."""
    from halfmoon.cluster.config import load_config
    from halfmoon.cluster.control.launcher import Cluster

    began = time.monotonic()
    config = settings(model, layout, args.staging_mib << 20, args.router_profile)
    cluster = Cluster(load_config(None, config))
    try:
        ports = cluster.start()
        start_s = time.monotonic() - began
        names = node_names()
        nodes = {
            name: names.get(ray.get(w.actor.node_id.remote()), "?")
            for name, w in cluster.workers.items()
        }
        grpc = f"{HOST}:{ports['grpc_port']}"
        spec = grpc if args.backend == "grpc" else f"http://{HOST}:{ports['http_port']}"
        target = make_target(spec, argparse.Namespace(**{**vars(args), "model": None}), tokenizer)
        before = worker_counters(cluster)
        results, duration_s = asyncio.run(bench_target(target, requests, vocabulary, args))
        counters = grown(before, worker_counters(cluster))
        figures = summarize(results, duration_s, parse_percentiles(args.metric_percentiles))
        transfer = kv_transfer(grpc)
    finally:
        cluster.stop()
    wait_stores_gone(cluster)
    return {
        "nodes": nodes,
        "kv_transfer": transfer,
        "counters": counters,
        "start_s": start_s,
        "server": target.server,
        **figures,
    }


def wait_stores_gone(cluster, timeout_s: float = 30.0) -> None:
    """Wait until the stopped cluster's named store actors are gone (the next cluster's stores
    take the same names)."""
    from halfmoon.kvstore.store_node import store_node_name

    names = [store_node_name(node_id) for node_id in node_names()]
    deadline = time.monotonic() + timeout_s
    while names and time.monotonic() < deadline:
        names = [name for name in names if actor_exists(name)]
        time.sleep(0.2)


def actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def judge(layouts: dict) -> dict:
    """The ratios split / one-node and issue 48's goal on TTFT p50."""
    split, one = layouts["split"], layouts["one_node"]
    every = ratios(one, split)
    value = every.get("p50_ttft_ms") or every.get("median_ttft_ms")
    met = value is not None and value <= GOAL
    return {
        "ratio_split_over_one_node": every,
        "goal": {"ttft_p50_ratio": value, "bound": f"<= {GOAL}", "met": met},
    }


def measure(args) -> dict:
    """Both layouts on one set of Ray nodes, the same requests to each in turn."""
    from halfmoon.engine.model_source import resolve_model

    model = str(resolve_model(args.model))
    tokenizer, vocabulary = load_vocabulary(args.tokenizer or args.model)
    requests = build_requests(args, vocabulary)
    # Ray turns a loopback address given to ray.init into the machine's own address unless it
    # runs as on a laptop (no cluster): keep this driver on 127.0.0.1 as the nodes are.
    clustered, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    nodes = start_nodes()
    try:
        ray.init(address=nodes.address, namespace="halfmoon", log_to_driver=False)
        layouts = {
            layout: serve_layout(layout, model, requests, vocabulary, tokenizer, args)
            for layout in LAYOUTS
        }
    finally:
        ray.shutdown()
        nodes.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = clustered
    return {
        "model": model,
        "cores": os.cpu_count(),
        "config": run_config(args, requests),
        "layouts": layouts,
        **judge(layouts),
    }


def number(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_report(report: dict) -> None:
    print("load: " + json.dumps(report["config"]))
    print(f"{'layout':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)")
    rows = [*report["layouts"].items(), ("split/one", report["ratio_split_over_one_node"])]
    for layout, figures in rows:
        print(f"{layout:<10} " + " ".join(f"{number(figures.get(k)):>9}" for k in FIGURES))
    for layout, run_ in report["layouts"].items():
        where = ", ".join(f"{name} on the {node}" for name, node in run_["nodes"].items())
        done = f"{run_['completed']} completed, {run_['failed']} failed"
        print(f"{layout}: {where}; {done}; started in {run_['start_s']:.1f} s")
        for name, path in run_["kv_transfer"].items():
            counts = run_["counters"].get(name, {})
            print(f"  {name:<10} kv_transfer {path or '-'!r:<16} " + json.dumps(counts))
    goal = report["goal"]
    verdict = "met" if goal["met"] else "NOT met"
    print(
        f"TTFT p50 split / one-node = {number(goal['ttft_p50_ratio'])} (goal {goal['bound']}: "
        f"{verdict})"
    )
    print(
        f"note: every Ray node is on this machine; its {report['cores']} cores are shared by "
        "both workers, the router and the raylets (they time-slice them)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("serve --across-nodes", __doc__, progress=True)
    parser.add_argument(
        "--model", help="checkpoint both layouts serve (default: the tiny default model)"
    )
    parser.add_argument(
        "--tokenizer", help="tokenizer of the prompts' ids (default: --model's, or the tiny one)"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="grpc",
        help="how the load goes: halfmoon's gRPC stream (%(default)s) or its OpenAI HTTP API",
    )
    add_workload_options(
        parser, 40, "requests per layout (%(default)s)", "seed of prompts and arrivals (0)"
    )
    parser.add_argument(
        "--request-rate", type=float, default=2.0, help="Poisson arrivals per second (2.0)"
    )
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    parser.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent one by one first, unmeasured (0)"
    )
    parser.add_argument(
        "--metric-percentiles", default="50,99", help="percentiles per latency (50,99)"
    )
    parser.add_argument(
        "--staging-mib", type=int, default=64, help="the decode worker's staging memory (64)"
    )
    parser.add_argument(
        "--router-profile",
        help="the router's cost-model profile, a deploy/profiles name or a YAML file (default: "
        "measured at each cluster's start, as `halfmoon serve` does)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per request (300)")
    parser.set_defaults(
        random_input_len=256,
        random_output_len=32,
        arrival=None,
        burstiness=1.0,
        time_scale=1.0,
        goodput=[],
        api_key=None,
        endpoint=None,
        prompt_format="token_ids",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    percentiles = {*parse_percentiles(args.metric_percentiles), 50.0, 99.0}
    args.metric_percentiles = ",".join(f"{p:g}" for p in sorted(percentiles))
    return report_main("halfmoon bench serve --across-nodes", measure, print_report, args)


if __name__ == "__main__":
    sys.exit(main())
