"""A live disaggregated cluster with its KV cache in fp8 (`engine.kv_cache_dtype`): the
offline engine's tokens with fp8 KV, the KV moved and stored quantized on every path it takes
(lent pages, the arena, the store's stream, the host tier, Redis), a prefix stored quantized in
Redis reused, the store and the router's transfer prices counting the quantized bytes."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from cluster_kit import running_cluster

from halfmoon.bench.probes import transfer as bench_transfer
from halfmoon.engine import LLM, SamplingParams
from halfmoon.kernels.kv_quant import SCALE_BYTES

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

PREFIX = "A long system prompt, kept in Redis in 8 bits once the host tier lets it go. " * 8
FILLERS = [f"Unrelated traffic number {i} that pushes the prefix out. " * 12 for i in range(3)]
KiB = 1 << 10
ENGINE = {"num_pages": 128, "prefill_chunk_size": 64, "max_num_batched_tokens": 256}
SETTINGS = {
    "prefill.replicas": 1,
    "decode.replicas": 1,
    # About 60 blocks of the tiny model's fp8 KV (8.5 KiB each): the fillers evict the prefix.
    "store.host_capacity_bytes": 512 * KiB,
    "store.use_local_redis": True,
    "router.bypass_threshold_tokens": 0,
    "engine.kv_cache_dtype": "fp8",
    **{f"engine.{key}": value for key, value in ENGINE.items()},
}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def test_fp8_kv_serves_the_offline_engine_tokens_and_moves_a_quarter_of_fp32(tiny_model_dir):
    with running_cluster(tiny_model_dir, **SETTINGS) as (cluster, client):
        details = client.server_info().details
        first = client.complete(PREFIX + "first", max_tokens=6, temperature=0.0)
        stored = _host_blocks_and_bytes(client)
        for filler in FILLERS:
            client.complete(filler, max_tokens=2, temperature=0.0)
        _wait_for_demotions(client)
        second = client.complete(PREFIX + "second", max_tokens=6, temperature=0.0, request_id="2")
        (summary,) = ray.get(cluster.router.summaries.remote(["2"]))
        # Each path (lent pages, the arena, the store, no streaming): 2 units of 64 tokens.
        moved = asyncio.run(bench_transfer.run(cluster, [2], 64, 1, seed=5))
    # The offline engine with fp8 KV, the prefix cached (quantized) before the second prompt.
    offline = LLM(str(tiny_model_dir), kv_cache_dtype="fp8", **ENGINE)
    expected = [offline.generate([PREFIX + end], GREEDY)[0] for end in ("first", "second")]
    assert first.token_ids == expected[0].token_ids
    assert second.token_ids == expected[1].token_ids
    assert summary["loaded_from"] == "redis" and summary["num_loaded_tokens"] >= 16 * 20, summary
    # fp32 rows of 32 values (128 bytes) stored as 32 fp8 values and a 2-byte scale.
    layers, heads, head_dim, block = 4, 2, 32, 16
    block_bytes = 2 * layers * block * heads * (head_dim + SCALE_BYTES)
    blocks, num_bytes = stored
    assert blocks > 0 and num_bytes == blocks * block_bytes
    assert details["profile"]["kv_bytes_per_token"] == block_bytes // block  # 544, fp32's 2048
    assert [r.path for r in moved] == ["pages", "arena", "store", "off"]
    assert all(r.kv_bytes == 2 * 64 * block_bytes // block for r in moved), moved
    workers = details["workers"].values()
    assert {w["kind"] for w in workers} == {"prefill", "decode"}


def _host_blocks_and_bytes(client) -> tuple[int, int]:
    stores = client.server_info().details["stores"].values()
    return sum(s["host"]["blocks"] for s in stores), sum(s["host"]["bytes_"] for s in stores)


def _wait_for_demotions(client, timeout_s: float = 30.0) -> None:
    """Until the store has demoted evicted blocks to Redis and the router heard of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stores = client.server_info().details["stores"].values()
        if any(s["host"]["evictions"] > 0 and s["redis"]["bytes_written"] > 0 for s in stores):
            time.sleep(1.5)  # the router polls the stores' events about every second
            return
        time.sleep(0.2)
    raise AssertionError("no block was demoted to Redis")
