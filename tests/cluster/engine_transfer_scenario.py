"""KV across Ray nodes on Mooncake's Transfer Engine, run by test_engine_transfer.py in a process
of its own (one Ray instance per process): `python engine_transfer_scenario.py MODEL OUT.json`.
A head, a `prefill` node and a `decode` node made by ray.cluster_utils.Cluster on this machine,
`store.transfer.engine: mooncake` (its TCP transport between the nodes' worker processes).
Two prefill nodes, one prefill worker each. Prompts are served, then the workers' counters
read; a prefix is fetched from the other prefill node's store and a worker warmed from there
(fetch_scenario.py's plan), both read on the engine; then the node of the prefill worker
writing a prompt's layers is killed mid-transfer, and the router retries the prompt on the
other. Writes what it saw as JSON for the test to judge."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import ray
from fetch_scenario import MAX_TOKENS as FETCH_TOKENS
from fetch_scenario import PREFIX, QUESTIONS, serve
from ray.cluster_utils import Cluster as RayCluster
from scenario_kit import (
    NODE,
    NODES_TIMEOUT_S,
    kv_block_bytes,
    pool_settings,
    started,
    write_report,
)

from halfmoon.cluster.client.grpc_client import Client
from halfmoon.cluster.frontend.grpc_errors import ServerError
from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.tokenizer import load_tokenizer, tokenize_prompt
from halfmoon.kvstore.keys import block_keys

PROMPTS = ["Across the nodes on the engine " * 6, "a prompt of a few blocks " * 3, "short"]
LONG = "a prompt long enough to be mid-transfer when its prefill node dies " * 12
MAX_TOKENS = 8
CALL_TIMEOUT_S = 180.0
BLOCK_SIZE = 16
SETTINGS = {
    "engine.prefill_chunk_size": 64,
    "engine.max_num_batched_tokens": 256,
    # The shipped CPU profile: fetching fetch_scenario's prefix beats computing it.
    "router.profile": "cpu-tiny",
    "store.get_timeout_s": 10.0,
    "store.transfer.engine": "mooncake",
    "store.transfer.host": "127.0.0.1",  # the nodes are on this machine: loopback only
    "store.transfer.staging_bytes": 64 << 20,
    "health.timeout_s": 5.0,
    "health.unresponsive_s": 10.0,
}


def greedy(client: Client, prompt: str) -> list[int] | str:
    try:
        out = client.complete(
            prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=CALL_TIMEOUT_S
        )
    except ServerError as error:
        return error.code
    return out.token_ids


def counters(cluster, name: str) -> dict:
    return ray.get(cluster.workers[name].actor.counters.remote())


def kill_mid_transfer(client: Client, cluster, nodes: dict, outcome: list) -> str | None:
    """Serve LONG in a thread; once one prefill worker has written a layer of it, kill that
    worker's node (its process goes with its raylet). Returns the killed worker's name."""
    prefills = [name for name, w in cluster.workers.items() if w.kind == "prefill"]
    before = {name: counters(cluster, name)["num_engine_writes"] for name in prefills}
    thread = threading.Thread(target=lambda: outcome.append(greedy(client, LONG)), daemon=True)
    thread.start()
    deadline, killed = time.monotonic() + 60, None
    while killed is None and time.monotonic() < deadline:
        for name in prefills:
            if counters(cluster, name)["num_engine_writes"] > before[name]:
                killed = name
        time.sleep(0.002)
    if killed is not None:
        nodes[ray.get(cluster.workers[killed].actor.node_id.remote())].kill_raylet()
    killed_at = time.monotonic()
    thread.join(CALL_TIMEOUT_S)
    outcome.append(time.monotonic() - killed_at)  # the kill to the retried request's end
    return killed


def fetch_and_warm(cluster, client: Client) -> dict:
    """fetch_scenario's plan on the engine (its `serve`: the first prompt on one prefill
    worker, which then drains, so the second, the same prefix, goes to the other, which fetches
    the prefix from the first's store); then that worker is warmed from there with the first
    prompt's blocks (all it lacks is what follows the prefix). The drained worker serves again
    after."""
    prompts = [PREFIX + question for question in QUESTIONS]
    served = serve(cluster, client, prompts)
    holder = served["first"]["prefill_instance"]
    taker = cluster.workers[served["second"]["prefill_instance"]].actor
    fetched = ray.get(taker.counters.remote())
    holder_store = served["stores"][holder]
    warmed = ray.get(taker.warm.remote(prompt_keys(taker, prompts[0]), holder_store))
    ray.get(cluster.router.set_draining.remote(holder, False))
    return {
        "outputs": served["outputs"],
        "holder_store": holder_store,
        "second": served["second"],
        "counters": [fetched, ray.get(taker.counters.remote())],
        "warmed": warmed,
    }


def prompt_keys(worker, prompt: str) -> list[bytes]:
    """The prompt's full-block keys, as the router hashes them."""
    info = ray.get(worker.info.remote())
    tokens = tokenize_prompt(load_tokenizer(Path(info.model)), prompt, info.vocab_size)
    return block_keys(info.root_key, tokens, info.block_size)


def main(model: str, out_path: str) -> None:
    offline = LLM(model, num_pages=256, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate([*PROMPTS, LONG], params)]
    fetch_params = SamplingParams(max_tokens=FETCH_TOKENS, temperature=0.0, ignore_eos=True)
    fetch_prompts = [PREFIX + question for question in QUESTIONS]
    expected_fetch = [o.token_ids for o in offline.generate(fetch_prompts, fetch_params)]
    tokenizer = offline.tokenizer
    num_blocks = [-(-len(tokenizer.encode(p)) // BLOCK_SIZE) for p in [*PROMPTS, LONG]]
    del offline

    nodes = RayCluster(initialize_head=True, head_node_args=dict(NODE))
    prefill_nodes = [nodes.add_node(**NODE, resources={"prefill": 1}) for _ in range(2)]
    nodes.add_node(**NODE, resources={"decode": 1})
    nodes.wait_for_nodes(NODES_TIMEOUT_S)
    by_id = {node.node_id: node for node in prefill_nodes}
    report: dict = {
        "expected": expected,
        "num_blocks": num_blocks,
        "expected_fetch": expected_fetch,
    }
    settings = pool_settings(model, **SETTINGS, **{"prefill.replicas": 2})
    with started(nodes, settings) as (cluster, ports):
        (decode,) = [name for name, w in cluster.workers.items() if w.kind == "decode"]
        report["block_bytes"] = kv_block_bytes(cluster.workers[decode].actor)
        prefills = [name for name, w in cluster.workers.items() if w.kind == "prefill"]
        with Client(f"127.0.0.1:{ports['grpc_port']}") as client:
            # (counters before and after: the cluster's start-up served requests of its own)
            report["prefill_before"] = [counters(cluster, name) for name in prefills]
            report["decode_before"] = counters(cluster, decode)
            report["outputs"] = [greedy(client, p) for p in PROMPTS]
            workers = client.server_info().details["workers"]
            report["status"] = {name: load["kv_transfer"] for name, load in workers.items()}
            report["prefill"] = [counters(cluster, name) for name in prefills]
            report["decode"] = counters(cluster, decode)
            report["fetch"] = fetch_and_warm(cluster, client)
            outcome: list = []
            report["killed"] = kill_mid_transfer(client, cluster, by_id, outcome)
            report["outcome_after_kill"] = outcome[0] if len(outcome) == 2 else "hung"
            report["retried_in_s"] = outcome[-1]
            report["output_again"] = greedy(client, LONG)
            report["decode_after"] = counters(cluster, decode)
    write_report(out_path, report)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
