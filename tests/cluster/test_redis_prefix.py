"""Every plan is executed: a prefix whose blocks are only in Redis (evicted from the worker's
pages and from the host tier, demoted to Redis) is loaded from Redis, never recomputed while
the router counted it as a hit."""

from __future__ import annotations

import time

import pytest
import ray
from cluster_kit import running_cluster

from halfmoon.engine import SamplingParams

PREFIX = "A long system prompt, kept in Redis once the faster tiers let it go. " * 10
FILLERS = [f"Unrelated traffic number {i} that pushes the prefix out. " * 12 for i in range(3)]
KiB = 1 << 10
SMALL_TIERS = {
    "prefill.replicas": 1,
    "decode.replicas": 1,
    # About 60 blocks of the tiny model's KV (32 KiB each): the fillers evict the prefix.
    "store.host_capacity_bytes": 2048 * KiB,
    "engine.num_pages": 128,
    "engine.prefill_chunk_size": 64,
    "engine.max_num_batched_tokens": 256,
    "router.bypass_threshold_tokens": 0,
}

pytestmark = pytest.mark.timeout(300)


def test_a_prefix_only_in_redis_is_loaded_from_redis_and_outputs_match(tiny_model_dir, tiny_llm):
    settings = {**SMALL_TIERS, "store.use_local_redis": True}
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        _push_to_redis(client)
        out = client.complete(PREFIX + "second", max_tokens=6, temperature=0.0, request_id="two")
        (summary,) = ray.get(cluster.router.summaries.remote(["two"]))
        explained = client.explain("two")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    assert out.token_ids == tiny_llm.generate([PREFIX + "second"], params)[0].token_ids
    assert "'redis')" in explained, explained
    assert summary["loaded_from"] == "redis", (summary, explained)
    assert summary["num_loaded_tokens"] >= 16 * 30, (summary, explained)


def _wait_for_demotions(client, timeout_s: float = 30.0) -> None:
    """Until the store has demoted evicted blocks to Redis and the router heard of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stores = client.server_info().details["stores"].values()
        if any(
            figures["host"]["evictions"] > 0 and figures["redis"]["bytes_written"] > 0
            for figures in stores
        ):
            time.sleep(1.5)  # the router polls the stores' events about every second
            return
        time.sleep(0.2)
    raise AssertionError("no block was demoted to Redis")


def test_forged_records_are_refused_and_a_redis_outage_costs_no_request(
    tiny_model_dir, tiny_llm, redis_server
):
    import redis

    if redis_server.process is None:
        redis_server.start()
    client_redis = redis.Redis.from_url(redis_server.url)
    client_redis.flushdb()
    settings = {**SMALL_TIERS, "store.redis_url": redis_server.url}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with running_cluster(tiny_model_dir, **settings) as (_, client):
        _push_to_redis(client)
        # Tamper with every record of the prefix: each one fails its HMAC.
        for name in client_redis.scan_iter("hm:kv:*"):
            value = bytearray(client_redis.get(name))
            value[len(value) // 2] ^= 0xFF
            client_redis.set(name, bytes(value))
        forged = client.complete(PREFIX + "forged", max_tokens=6, temperature=0.0)
        refused = sum(s["redis"]["forged"] for s in client.server_info().details["stores"].values())
        redis_server.stop()  # Redis goes away under load, and comes back
        during = [client.complete(f + "down", max_tokens=6, temperature=0.0) for f in FILLERS]
        redis_server.start()
        after = client.complete(PREFIX + "after", max_tokens=6, temperature=0.0)
    client_redis.close()
    prompts = [PREFIX + "forged", *[f + "down" for f in FILLERS], PREFIX + "after"]
    expected = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    assert [out.token_ids for out in [forged, *during, after]] == expected
    assert refused > 0


def _push_to_redis(client) -> None:
    """The prefix computed, then evicted from the host tier (to Redis) by the fillers."""
    client.complete(PREFIX + "first", max_tokens=2, temperature=0.0, request_id="first")
    for i, filler in enumerate(FILLERS):
        client.complete(filler, max_tokens=2, temperature=0.0, request_id=f"filler-{i}")
    _wait_for_demotions(client)
