"""Prefill and decode workers at different tensor-parallel degrees (real Ray actors, their ranks
real processes, gloo on CPU): the KV moves between them whole-head over today's paths, so the
outputs are the offline engine's, each head moves once, and a prefix one degree stored is loaded
at the other. One cluster per pair of degrees serves the module's tests, in the file's order."""

from __future__ import annotations

import pytest
import ray
import torch
from cluster_kit import counters, kv_transfer_bytes, running_cluster, wait_until

from halfmoon.engine import SamplingParams

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

PROMPTS = ["Hello there", "x" * 150, "The quick brown fox", "zz" * 40]
PREFIX = "A system prompt that both degrees share, " * 3
# Every prompt is handed from a prefill worker to a decode worker (no short-prompt bypass).
HANDOFF = {"router.bypass_threshold_tokens": 0}
# A partial block alone; several transfer units, the last block partial.
SIZED_PROMPTS = ["Each head once", "Whole heads, never twice " * 5]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p2d1", "p1d2"])
def degrees_cluster(request, ray_session, tiny_model_dir):
    """A live cluster of a prefill worker and a decode worker at degrees `request.param`."""
    prefill_tp, decode_tp = request.param
    shape = {
        "prefill.tensor_parallel_size": prefill_tp,
        "decode.tensor_parallel_size": decode_tp,
        **HANDOFF,
    }
    with running_cluster(tiny_model_dir, **shape) as (cluster, client):
        yield cluster, client, prefill_tp, decode_tp


def _expected(tiny_llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token_ids for out in tiny_llm.generate(prompts, params)]


def _kv_bytes(tiny_llm, num_tokens: int) -> int:
    """K and V of every layer and KV head, once, over the blocks that hold `num_tokens`."""
    cfg, block_size = tiny_llm.engine.model_config, tiny_llm.engine.config.block_size
    block_tokens = -(-num_tokens // block_size) * block_size
    dtype_bytes = torch.empty((), dtype=tiny_llm.engine.dtype).element_size()
    return cfg.num_layers * 2 * block_tokens * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def _degrees(cluster) -> dict[str, int]:
    return {
        w.kind: ray.get(w.actor.info.remote()).tensor_parallel_size
        for w in cluster.workers.values()
    }


def _swap_prefill_worker(cluster, degree: int) -> str:
    """Replace the prefill worker by one of `degree`; returns the new one's name."""
    (old,) = [name for name in cluster.workers if name.startswith("prefill")]
    pool = cluster.config.prefill.model_copy(update={"tensor_parallel_size": degree})
    cluster.config = cluster.config.model_copy(update={"prefill": pool})
    new = cluster.add_worker("prefill")
    cluster.remove_worker(old)
    return new.name


def test_bytes_moved_per_request_are_its_kv_size_with_no_head_twice(degrees_cluster, tiny_llm):
    cluster, client, prefill_tp, decode_tp = degrees_cluster
    assert _degrees(cluster) == {"prefill": prefill_tp, "decode": decode_tp}  # runs first
    (decode,) = [w.actor for w in cluster.workers.values() if w.kind == "decode"]
    port = cluster.ports["metrics_port"]
    before = kv_transfer_bytes(port)
    results = [
        client.complete(p, max_tokens=2, temperature=0.0, request_id=f"sized-{i}")
        for i, p in enumerate(SIZED_PROMPTS)
    ]
    moved = [ray.get(decode.receive_timings.remote(r.request_id)).num_bytes for r in results]
    assert moved == [_kv_bytes(tiny_llm, r.usage.prompt_tokens) for r in results]
    # The router's halfmoon_kv_transfer_bytes_total counts the same bytes.
    wait_until(lambda: kv_transfer_bytes(port) - before >= sum(moved))
    assert kv_transfer_bytes(port) - before == sum(moved)


def test_the_router_times_each_pool_at_its_degree_and_says_so(degrees_cluster):
    cluster, client, prefill_tp, decode_tp = degrees_cluster
    details = client.server_info().details
    degrees = {w["kind"]: w["tensor_parallel_size"] for w in details["workers"].values()}
    assert degrees == {"prefill": prefill_tp, "decode": decode_tp}
    profile = details["profile"]  # cpu-tiny, timed at degree 1, scaled to the pools' degrees
    assert profile["name"].endswith(f"@tp{prefill_tp}/{decode_tp}")
    assert (profile["tensor_parallel_size"], profile["decode_tensor_parallel_size"]) == (
        prefill_tp,
        decode_tp,
    )
    done = client.complete("Which degrees?", max_tokens=2, temperature=0.0)
    assert f"tp={prefill_tp}/{decode_tp}" in client.explain(done.request_id)


def test_workers_at_different_degrees_give_the_offline_outputs_and_share_prefixes(
    degrees_cluster, tiny_llm
):
    cluster, client, prefill_tp, decode_tp = degrees_cluster
    (decode_name,) = [name for name in cluster.workers if "decode" in name]
    before = counters(cluster, decode_name)
    results = [client.complete(p, max_tokens=8, temperature=0.0) for p in PROMPTS]
    first = client.complete(PREFIX + "first", max_tokens=6, temperature=0.0)
    after = counters(cluster, decode_name)
    decode = {key: after[key] - before[key] for key in ("num_page_copies", "num_direct_receives")}
    # The prefix is in the store at `prefill_tp`; a prefill worker of the other degree loads it
    # from there.
    loader = _swap_prefill_worker(cluster, decode_tp)
    second = client.complete(PREFIX + "second", max_tokens=6, temperature=0.0)
    loaded = counters(cluster, loader)
    degrees = _degrees(cluster)
    assert [r.token_ids for r in results] == _expected(tiny_llm, PROMPTS, 8)
    assert [first.token_ids, second.token_ids] == _expected(
        tiny_llm, [PREFIX + "first", PREFIX + "second"], 6
    )
    assert degrees == {"prefill": decode_tp, "decode": decode_tp}
    # A one-rank prefill worker lends its pages; the decode worker copies its heads out of them.
    assert (decode["num_page_copies"] > 0) == (prefill_tp == 1)
    assert decode["num_direct_receives"] == len(PROMPTS) + 1
    prefix_tokens = (len(PREFIX) // 16) * 16
    assert loaded["num_loaded_tokens"] == prefix_tokens
    assert second.usage.cached_tokens == prefix_tokens
