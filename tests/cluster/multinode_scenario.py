"""halfmoon across several Ray nodes on one machine, run by test_multinode.py in a process of
its own (a pytest process holds one Ray instance only): `python multinode_scenario.py MODEL
OUT.json`. A head, two `prefill` nodes and a `decode` node made by ray.cluster_utils.Cluster
carry two halfmoon clusters in turn (one Ray boot for both). The first: a prefill worker on each
prefill node, the decode worker on the decode node, a store node on each node, so KV crosses
nodes through the stores (as Ray objects: every node is on this machine); a prefix is fetched
from the other prefill node's store (scenario_kit.py's fetch plan); then the decode node dies
during traffic, and the controller replaces its worker on a spare `decode` node. The second,
where Mooncake's Transfer Engine imports, moves KV on it (engine_transfer_scenario.py). Writes
what it saw as JSON for the test to judge."""

from __future__ import annotations

import sys
import threading
import time

import engine_transfer_scenario
import ray
from cluster_kit import kv_transfer_bytes
from ray.cluster_utils import Cluster as RayCluster
from scenario_kit import (
    FETCH_MAX_TOKENS,
    FETCH_PREFIX,
    FETCH_QUESTIONS,
    HEAD,
    NODE,
    NODES_TIMEOUT_S,
    connected,
    pool_settings,
    serve_fetched,
    started,
    write_report,
)

from halfmoon.cluster.client.grpc_client import Client
from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.cluster.frontend.grpc_errors import ServerError
from halfmoon.engine import LLM, SamplingParams

PROMPTS = ["Across the nodes " * 5, "KV moves through the stores " * 3, "short one"]
MAX_TOKENS = 8
# Long enough that the decode node dies while these stream.
DURING_REMOVAL = [f"{i} request in flight when its node dies " * 2 for i in range(4)]
DURING_MAX_TOKENS = 384  # still streaming when the node dies: 96 tokens could end first
CALL_TIMEOUT_S = 120.0
SETTINGS = {
    "engine.prefill_chunk_size": 32,
    "engine.max_num_batched_tokens": 128,
    "store.get_timeout_s": 10.0,
    "health.timeout_s": 5.0,
    "health.unresponsive_s": 10.0,
    "prefill.replicas": 2,
}


def greedy(client: Client, prompt: str, max_tokens: int) -> list[int] | str:
    """The tokens, or the gRPC status name of a failure."""
    try:
        out = client.complete(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=CALL_TIMEOUT_S
        )
    except ServerError as error:
        return error.code
    return out.token_ids


def placement(cluster: Cluster) -> dict[str, str]:
    return {name: ray.get(w.actor.node_id.remote()) for name, w in cluster.workers.items()}


def store_figures(cluster: Cluster) -> dict[str, dict]:
    figures = {}
    for node_id, store in cluster.stores.items():
        stats = ray.get(store.stats.remote())
        host = stats.host
        figures[node_id] = {"capacity_bytes": host.capacity_bytes, "blocks": host.blocks}
    return figures


def wait_for(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            return value
        time.sleep(0.2)
    return value


def all_registered(controller: Controller) -> bool:
    """One controller round; True once no started worker is waiting for a node."""
    controller.check_health()
    return not controller.pending


def run_during_removal(client: Client, remove) -> tuple[list, list[int]]:
    """Stream DURING_REMOVAL concurrently, call `remove` once decode output flows (a second
    delta: the first is the prefill's token); returns each request's outcome and the indices
    of requests still running after CALL_TIMEOUT_S."""
    outcomes: list = [None] * len(DURING_REMOVAL)
    decoding = threading.Event()

    def run(i: int) -> None:
        try:
            stream = client.generate(
                DURING_REMOVAL[i],
                max_tokens=DURING_MAX_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                timeout=CALL_TIMEOUT_S,
            )
            tokens, deltas = [], 0
            with stream:
                for delta in stream:
                    tokens += delta.token_ids
                    deltas += 1
                    if deltas >= 2:
                        decoding.set()
            outcomes[i] = tokens
        except ServerError as error:
            outcomes[i] = error.code

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    decoding.wait(CALL_TIMEOUT_S)
    remove()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S + 10)
    return outcomes, [i for i, t in enumerate(threads) if t.is_alive()]


def main(model: str, out_path: str) -> None:
    offline = LLM(model, num_pages=256, max_num_batched_tokens=128)
    report = expectations(offline)
    engine_missing = engine_transfer_scenario.unavailable()
    on_engine = {} if engine_missing else engine_transfer_scenario.expectations(offline)
    del offline

    nodes = RayCluster(initialize_head=True, head_node_args=dict(HEAD))
    prefill_nodes = [nodes.add_node(**NODE, resources={"prefill": 1}) for _ in range(2)]
    decode_node = nodes.add_node(**NODE, resources={"decode": 1})
    nodes.wait_for_nodes(NODES_TIMEOUT_S)
    report["prefill_nodes"] = sorted(node.node_id for node in prefill_nodes)
    report["decode_node"] = decode_node.node_id
    with connected(nodes):
        report.update(through_the_stores(nodes, model, decode_node))
        if engine_missing:
            report["engine"] = {"unavailable": engine_missing}
        else:
            by_id = {node.node_id: node for node in prefill_nodes}
            report["engine"] = {**on_engine, **engine_transfer_scenario.run(model, by_id)}
    write_report(out_path, report)


def expectations(offline: LLM) -> dict:
    """The offline engine's outputs of PROMPTS, DURING_REMOVAL and the fetch plan's prompts."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    during = SamplingParams(max_tokens=DURING_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    fetch = SamplingParams(max_tokens=FETCH_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    fetch_prompts = [FETCH_PREFIX + question for question in FETCH_QUESTIONS]
    return {
        "expected": [o.token_ids for o in offline.generate(PROMPTS, params)],
        "expected_during": [o.token_ids for o in offline.generate(DURING_REMOVAL, during)],
        "expected_fetch": [o.token_ids for o in offline.generate(fetch_prompts, fetch)],
    }


def through_the_stores(nodes: RayCluster, model: str, decode_node) -> dict:
    """The first cluster: KV through the stores, a fetch, the decode node lost and replaced."""
    report: dict = {}
    with started(pool_settings(model, **SETTINGS)) as (cluster, ports):
        report["head"] = ray.get_runtime_context().get_node_id()
        report["placement"] = placement(cluster)
        report["router_node"] = ray.get(cluster.router.node_id.remote())
        report["memory"] = {n["NodeID"]: n["Resources"]["memory"] for n in ray.nodes()}
        with Client(f"127.0.0.1:{ports['grpc_port']}") as client:
            report["outputs"] = [greedy(client, p, MAX_TOKENS) for p in PROMPTS]
            report["stores"] = store_figures(cluster)
            moved = wait_for(lambda: kv_transfer_bytes(ports["metrics_port"]), 30)
            report["kv_transfer_bytes"] = moved
            report["fetch"] = serve_fetched(cluster, client)

            # A decode worker with no node to go to: the controller starts it and goes on.
            controller = Controller(cluster)
            report["started_without_room"] = controller.start_worker("decode")
            controller.check_health()
            report["pending_without_room"] = sorted(controller.pending)
            spare = nodes.add_node(**NODE, resources={"decode": 1})
            nodes.wait_for_nodes(NODES_TIMEOUT_S)
            report["spare_node"] = spare.node_id
            report["registered_on_spare"] = wait_for(lambda: all_registered(controller), 240)
            report["stores_before_removal"] = sorted(cluster.stores)

            def remove_decode_node() -> None:
                nodes.remove_node(decode_node, allow_graceful=False)

            outcomes, hung = run_during_removal(client, remove_decode_node)
            report["during_outcomes"], report["hung"] = outcomes, hung
            # Its worker is removed; the replacement has no room (the spare node is full).
            report["dead_removed"] = wait_for(
                lambda: controller.check_health() is not None and "decode-2" not in cluster.workers,
                120,
            )
            report["pending_after_removal"] = sorted(controller.pending)
            report["outputs_while_pending"] = [greedy(client, p, MAX_TOKENS) for p in PROMPTS]
            second_spare = nodes.add_node(**NODE, resources={"decode": 1})
            nodes.wait_for_nodes(NODES_TIMEOUT_S)
            report["second_spare_node"] = second_spare.node_id
            report["replaced"] = wait_for(lambda: all_registered(controller), 240)
            report["num_restarts"] = controller.num_restarts
            report["placement_after"] = placement(cluster)
            report["stores_after"] = sorted(cluster.stores)
            report["outputs_after"] = [greedy(client, p, MAX_TOKENS) for p in PROMPTS]
    return report


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
