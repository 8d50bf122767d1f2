"""The live cluster with its KV on CUDA: one GPU shared by every worker (fractional num_gpus),
in fp32 and in bf16 (what every benchmark serves), with lent pages and through the arena."""

from __future__ import annotations

import pytest
import ray
from cluster_kit import counters, running_cluster, wait_until
from test_cluster_serving import PROMPTS, _generate_concurrently, _placement

from halfmoon.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("ray_session")]
ON_GPU = {"prefill.num_gpus": 0.3, "decode.num_gpus": 0.3, "engine.dtype": "float32"}


# The offline engines' KV: a fixed small pool, not most of the GPU for the whole module.
OFFLINE_KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def cuda_llm(tiny_model_dir):
    return LLM(
        str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_memory_bytes=OFFLINE_KV_BYTES
    )


def _expected(llm, prompts, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "shape",
    [{"prefill.replicas": 1, "decode.replicas": 1}, {"mode": "colocated", "decode.replicas": 2}],
    ids=["1p1d", "colocated"],
)
def test_greedy_outputs_on_cuda_equal_the_offline_engine(tiny_model_dir, cuda_llm, shape):
    with running_cluster(tiny_model_dir, **ON_GPU, **shape) as (cluster, client):
        devices = {ray.get(w.actor.info.remote()).device for w in cluster.workers.values()}
        results = _generate_concurrently(client, PROMPTS)
        decodes = [counters(cluster, n) for n, w in cluster.workers.items() if w.kind == "decode"]
    assert devices == {"cuda"}
    assert [r.token_ids for r in results] == _expected(cuda_llm, PROMPTS)
    if shape.get("mode") != "colocated":  # copied out of the prefill worker's pages by CUDA IPC
        assert sum(c["num_lenders"] for c in decodes) == 1
        assert sum(c["num_page_copies"] for c in decodes) > 0


@pytest.mark.timeout(300)
def test_a_prefix_is_reused_from_the_store_and_an_abort_mid_transfer_leaks_nothing(
    tiny_model_dir, cuda_llm
):
    prefix = "The same long system prompt, " * 6
    first, second = prefix + "first question", prefix + "second one"
    shape = {"prefill.replicas": 2, "router.policy": "round_robin", "engine.prefill_chunk_size": 16}
    with running_cluster(tiny_model_dir, **ON_GPU, **shape) as (cluster, client):
        a = client.complete(first, max_tokens=6, temperature=0.0, request_id="first")
        b = client.complete(second, max_tokens=6, temperature=0.0, request_id="second")
        second_prefill = _placement(client.explain("second"))[0]
        loaded = counters(cluster, second_prefill)["num_loaded_tokens"]
        stream = client.generate("z" * 1500, max_tokens=4, request_id="aborted")
        stream.cancel()  # while its layers are still moving
        client.complete("after", max_tokens=2)
        for name in cluster.workers:
            wait_until(lambda n=name: counters(cluster, n)["num_used_pages"] == 0)
            assert counters(cluster, name)["num_running"] == 0
        store = next(iter(cluster.stores.values()))
        assert ray.get(store.stats.remote()).host.leased_blocks == 0
    assert loaded == (len(prefix) // 16) * 16
    assert b.usage.cached_tokens == loaded
    assert [a.token_ids, b.token_ids] == _expected(cuda_llm, [first, second], 6)


@pytest.mark.timeout(300)
def test_greedy_bf16_outputs_of_the_cluster_equal_the_offline_engine_in_bf16(tiny_model_dir):
    # One request at a time on both sides, with the cluster's chunking: the same shapes run,
    # so bf16 rounds alike (a different batch may round otherwise and flip a close argmax).
    bf16 = {**ON_GPU, "engine.dtype": "bfloat16", "prefill.replicas": 1, "decode.replicas": 1}
    with running_cluster(tiny_model_dir, **bf16) as (cluster, client):
        got = [client.complete(p, max_tokens=8, temperature=0.0).token_ids for p in PROMPTS]
        decode = next(n for n, w in cluster.workers.items() if w.kind == "decode")
        assert counters(cluster, decode)["num_page_copies"] > 0
    offline = LLM(
        str(tiny_model_dir),
        device="cuda",
        dtype="bfloat16",
        prefill_chunk_size=32,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=OFFLINE_KV_BYTES,
    )
    assert got == [_expected(offline, [p])[0] for p in PROMPTS]


@pytest.mark.timeout(300)
def test_with_lending_off_the_kv_comes_through_the_arena(tiny_model_dir, cuda_llm):
    shape = {"prefill.replicas": 1, "decode.replicas": 1, "store.lend_pages": False}
    with running_cluster(tiny_model_dir, **ON_GPU, **shape) as (cluster, client):
        results = _generate_concurrently(client, PROMPTS)
        decode = next(n for n, w in cluster.workers.items() if w.kind == "decode")
        seen = counters(cluster, decode)
    assert seen["num_lenders"] == 0 and seen["num_page_copies"] == 0
    assert seen["num_shared_reads"] > 0
    assert [r.token_ids for r in results] == _expected(cuda_llm, PROMPTS)
