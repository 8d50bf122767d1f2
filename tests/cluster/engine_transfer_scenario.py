"""KV across Ray nodes on Mooncake's Transfer Engine: the second halfmoon cluster of
multinode_scenario.py, on its nodes (a head, two `prefill` nodes, a `decode` one, on this
machine), with `store.transfer.engine: mooncake` (its TCP transport between the nodes' worker
processes) and one prefill worker on each prefill node. Prompts are served, then the workers'
counters read; a prefix is fetched from the other prefill node's store and a worker warmed from
there (scenario_kit.py's fetch plan), both read on the engine; then the node of the prefill
worker writing a prompt's layers is killed mid-transfer, and the router retries the prompt on
the other."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ray
from scenario_kit import (
    FETCH_PREFIX,
    FETCH_QUESTIONS,
    kv_block_bytes,
    pool_settings,
    serve_fetched,
    started,
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
    """scenario_kit's fetch plan on the engine (the first prompt on one prefill worker, which
    then drains, so the second, the same prefix, goes to the other, which fetches the prefix
    from the first's store); then that worker is warmed from there with the first prompt's
    blocks (all it lacks is what follows the prefix)."""
    served = serve_fetched(cluster, client)
    holder = served["first"]["prefill_instance"]
    taker = cluster.workers[served["second"]["prefill_instance"]].actor
    fetched = ray.get(taker.counters.remote())
    holder_store = served["stores"][holder]
    first_prompt = FETCH_PREFIX + FETCH_QUESTIONS[0]
    warmed = ray.get(taker.warm.remote(prompt_keys(taker, first_prompt), holder_store))
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


def unavailable() -> str | None:
    """Why this machine cannot run the engine (None: it can)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as error:
        return f"mooncake-transfer-engine cannot be imported: {error}"
    return None


def expectations(offline: LLM) -> dict:
    """The offline engine's outputs of PROMPTS and LONG, and their blocks."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [*PROMPTS, LONG]
    return {
        "expected": [o.token_ids for o in offline.generate(prompts, params)],
        "num_blocks": [-(-len(offline.tokenizer.encode(p)) // BLOCK_SIZE) for p in prompts],
    }


def run(model: str, prefill_nodes: dict) -> dict:
    """This cluster on the connected nodes; `prefill_nodes` are the prefill nodes by id (one
    of them is killed)."""
    report: dict = {}
    settings = pool_settings(model, **SETTINGS, **{"prefill.replicas": 2})
    with started(settings) as (cluster, ports):
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
            report["killed"] = kill_mid_transfer(client, cluster, prefill_nodes, outcome)
            report["outcome_after_kill"] = outcome[0] if len(outcome) == 2 else "hung"
            report["retried_in_s"] = outcome[-1]
            report["output_again"] = greedy(client, LONG)
            report["decode_after"] = counters(cluster, decode)
    return report
