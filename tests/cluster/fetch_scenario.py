"""A prefix fetched from another node's store, live: run by test_remote_fetch.py in a process
of its own (a pytest process holds one Ray instance only): `python fetch_scenario.py MODEL
OUT.json`.

Two `prefill` nodes (one prefill worker and one store node each) and the decode worker on
the head. A long prompt is prefilled on one prefill node; that worker then drains, and the
same prefix with another question goes to the other prefill node, which holds none of it: the
Conductor plans a fetch from the first node's store, and the worker loads the prefix from
there layer by layer. Writes what it saw as JSON for the test to judge."""

from __future__ import annotations

import sys
import time

import ray
from ray.cluster_utils import Cluster as RayCluster
from scenario_kit import NODE, NODES_TIMEOUT_S, pool_settings, started, write_report

from halfmoon.cluster.client.grpc_client import Client
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.engine import LLM, SamplingParams

PREFIX = "The long system prompt that every request of this tenant starts with. " * 40
QUESTIONS = ["What comes first?", "And what comes next?"]
MAX_TOKENS = 6
SETTINGS = {
    "engine.prefill_chunk_size": 64,
    "engine.max_num_batched_tokens": 256,
    "prefill.replicas": 2,
    # The shipped CPU profile: fetching this prefix beats computing it.
    "router.profile": "cpu-tiny",
}


def main(model: str, out_path: str) -> None:
    offline = LLM(model, num_pages=256, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [PREFIX + question for question in QUESTIONS]
    report: dict = {"expected": [o.token_ids for o in offline.generate(prompts, params)]}
    del offline
    nodes = RayCluster(initialize_head=True, head_node_args={**NODE, "resources": {"decode": 1}})
    first, second = (nodes.add_node(**NODE, resources={"prefill": 1}) for _ in range(2))
    nodes.wait_for_nodes(NODES_TIMEOUT_S)
    with started(nodes, pool_settings(model, **SETTINGS)) as (cluster, ports):
        with Client(f"127.0.0.1:{ports['grpc_port']}") as client:
            report.update(serve(cluster, client, prompts))
        report["prefill_nodes"] = sorted([first.node_id, second.node_id])
    write_report(out_path, report)


def serve(cluster: Cluster, client: Client, prompts: list[str]) -> dict:
    """The first prompt on one prefill worker; then that worker drains and the second goes to
    the other one."""
    outputs = [complete(client, prompts[0], "first")]
    (first,) = summaries(cluster, ["first"])
    holder = first["prefill_instance"]
    wait_indexed(cluster, client)
    ray.get(cluster.router.set_draining.remote(holder, True))
    outputs.append(complete(client, prompts[1], "second"))
    (second,) = summaries(cluster, ["second"])
    return {
        "outputs": outputs,
        "first": first,
        "second": second,
        "explain": client.explain("second"),
        "nodes": {name: ray.get(w.actor.node_id.remote()) for name, w in cluster.workers.items()},
        "stores": {name: ray.get(w.actor.store_name.remote()) for name, w in prefill(cluster)},
    }


def complete(client: Client, prompt: str, request_id: str) -> list[int]:
    out = client.complete(
        prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, request_id=request_id
    )
    return out.token_ids


def summaries(cluster: Cluster, request_ids: list[str]) -> list[dict]:
    return ray.get(cluster.router.summaries.remote(request_ids))


def prefill(cluster: Cluster):
    return [(name, w) for name, w in cluster.workers.items() if w.kind == "prefill"]


def wait_indexed(cluster: Cluster, client: Client, timeout_s: float = 30.0) -> None:
    """Until the router's index has heard of the first prompt's blocks in its node's store
    (the router polls the stores' events)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stores = client.server_info().details["stores"]
        if any(figures.get("host", {}).get("blocks", 0) > 0 for figures in stores.values()):
            time.sleep(1.0)  # one more poll of the router: the events follow the stats
            return
        time.sleep(0.2)
    raise TimeoutError("the store never reported the first prompt's blocks")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
