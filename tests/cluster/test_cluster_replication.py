"""Hot-prefix replication on a live cluster: a prefill worker warmed from the store serves
the prefix from its own pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
from cluster_kit import counters, running_cluster, wait_until, worker

from halfmoon.engine import SamplingParams
from halfmoon.engine.tokenizer import load_tokenizer, tokenize_prompt
from halfmoon.kvstore.keys import block_keys

pytestmark = pytest.mark.usefixtures("ray_session")


def test_a_warmed_prefill_worker_serves_the_prefix_from_its_own_pages(tiny_model_dir, tiny_llm):
    prefix = "The same long system prompt, " * 6
    first, second = prefix + "first question", prefix + "second one"
    settings = {
        "prefill.replicas": 2,
        "decode.replicas": 1,
        "router.policy": "round_robin",
        "engine.prefill_chunk_size": 16,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        client.complete(first, max_tokens=2, temperature=0.0, request_id="first")
        served = re.search(r"prefill=(\S+)", client.explain("first")).group(1)
        (other,) = [name for name in ("prefill-0", "prefill-1") if name != served]
        info = ray.get(worker(cluster, other).info.remote())
        tokens = tokenize_prompt(load_tokenizer(Path(info.model)), first, info.vocab_size)
        keys = block_keys(info.root_key, tokens, info.block_size)
        warmed = ray.get(worker(cluster, other).warm.remote(keys))
        again = ray.get(worker(cluster, other).warm.remote(keys))
        wait_until(lambda: _device_blocks(cluster, other, keys) == len(keys))
        # Round robin alternates, so the next request goes to the warmed worker.
        b = client.complete(second, max_tokens=6, temperature=0.0, request_id="second")
        placed = re.search(r"prefill=(\S+)", client.explain("second")).group(1)
        loaded = counters(cluster, other)["num_loaded_tokens"]
    assert (warmed, again) == (len(keys), 0)
    assert placed == other
    assert loaded == 0, "the prefix came from the worker's own pages, not the store"
    assert b.usage.cached_tokens == (len(prefix) // 16) * 16
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert b.token_ids == tiny_llm.generate([second], params)[0].token_ids


def _device_blocks(cluster, name: str, keys: list[bytes]) -> int:
    """Leading blocks of `keys` the router's prefix index holds on `name`'s own pages."""

    def lookup(router) -> int:
        return router.backend.conductor.view().longest_prefix(keys).get((name, "device"), 0)

    return ray.get(cluster.router.__ray_call__.remote(lookup))


def test_the_router_copies_a_hot_prefix_to_the_idle_prefill_worker(tiny_model_dir):
    prefix = "A system prompt every request of this tenant repeats, " * 4
    settings = {
        "prefill.replicas": 2,
        "decode.replicas": 1,
        "router.policy": "conductor",
        "router.bypass_threshold_tokens": 0,
        "router.replicate": True,
        "router.replicate_margin_s": 0.0,
        "engine.prefill_chunk_size": 16,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        client.complete(prefix + "one", max_tokens=2, temperature=0.0, request_id="one")
        holder = re.search(r"prefill=(\S+)", client.explain("one")).group(1)
        (idle,) = [name for name in ("prefill-0", "prefill-1") if name != holder]
        info = ray.get(worker(cluster, idle).info.remote())
        tokens = tokenize_prompt(load_tokenizer(Path(info.model)), prefix, info.vocab_size)
        keys = block_keys(info.root_key, tokens, info.block_size)
        wait_until(lambda: _device_blocks(cluster, holder, keys) == len(keys))
        # The next two requests read the prefix on its holder and make it hot (2 hits): a
        # copy goes to the worker that does not hold it, through the router's replication.
        for rid in ("two", "three"):
            client.complete(prefix + rid, max_tokens=2, temperature=0.0, request_id=rid)
        explained = client.explain("two") + client.explain("three")
        wait_until(lambda: _device_blocks(cluster, idle, keys) == len(keys))
    assert f"to {idle}" in explained and "hot blocks" in explained
