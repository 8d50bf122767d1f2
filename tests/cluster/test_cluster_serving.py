"""The disaggregated cluster end to end: real Ray actors, real store, real gRPC server."""

from __future__ import annotations

import threading

import grpc
import pytest
import ray
from cluster_kit import counters, running_cluster, wait_until, worker

from halfmoon.cluster.client.grpc_client import ServerError
from halfmoon.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = ["Hello there", "x" * 150, "The quick brown fox", "a" * 70, "q", "zz" * 40]


def _expected(tiny_llm, prompts, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token_ids for out in tiny_llm.generate(prompts, params)]


def _generate_concurrently(client, prompts, max_tokens=8):
    results = [None] * len(prompts)

    def run(i):
        results[i] = client.complete(prompts[i], max_tokens=max_tokens, temperature=0.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# Every prompt is handed from a prefill worker to a decode worker (the Conductor would
# prefill these short prompts on the decode worker: the short-prompt bypass).
HANDOFF = {"router.bypass_threshold_tokens": 0}


@pytest.mark.parametrize(
    "shape",
    [
        {"prefill.replicas": 1, "decode.replicas": 1, **HANDOFF},
        {"prefill.replicas": 1, "decode.replicas": 1, "store.direct_notices": False, **HANDOFF},
        {"prefill.replicas": 1, "decode.replicas": 1, "store.lend_pages": False, **HANDOFF},
        {"prefill.replicas": 2, "decode.replicas": 2, "router.policy": "round_robin"},
        {"mode": "colocated", "decode.replicas": 2},
    ],
    ids=["1p1d", "1p1d-store-notices", "1p1d-arena", "2p2d", "colocated"],
)
def test_greedy_outputs_over_grpc_equal_the_offline_engine(tiny_model_dir, tiny_llm, shape):
    with running_cluster(tiny_model_dir, **shape) as (cluster, client):
        results = _generate_concurrently(client, PROMPTS)
        client.complete("timed", max_tokens=2, request_id="timed")
        explained = client.explain("timed")
        decodes = [counters(cluster, name) for name in cluster.workers if "decode" in name]
        prefills = [counters(cluster, name) for name in cluster.workers if "prefill" in name]
    assert [r.token_ids for r in results] == _expected(tiny_llm, PROMPTS)
    if shape.get("mode") != "colocated":  # told by the prefill worker itself, or not at all
        direct = shape.get("store.direct_notices", True)
        assert (sum(c["num_direct_receives"] for c in decodes) > 0) == direct
        # copied straight out of the prefill worker's pages, which all went back to it
        lent = direct and shape.get("store.lend_pages", True)
        if lent or not direct:  # (out of the arena they sometimes all join after the hand-off)
            assert (sum(c["num_early_joins"] for c in decodes) > 0) == direct
        assert (sum(c["num_page_copies"] for c in decodes) > 0) == lent
        assert all(c["num_lent_pages"] == 0 for c in prefills)
        # Every layer went into the store's arena; the store was told of a unit's layers once
        # when the decode worker was told directly, else of each layer as it came.
        per_report = tiny_llm.engine.model_config.num_layers if direct else 1
        for c in prefills:
            assert c["num_shared_writes"] == per_report * c["num_store_reports"] > 0
    assert all(r.finish_reason == "length" for r in results)
    # The first output's way through the worker is in the router's timeline, in order (a
    # decode worker's first output is the prefill's token, joined without a step).
    colocated = shape.get("mode") == "colocated"
    steps = ["engine step began", "engine step ended"] if colocated else []
    worker_stages = [
        f"{'worker' if colocated else 'decode worker'}: {stage}"
        for stage in ["call began on the worker", *steps, "first output left the worker"]
    ]
    stages = [line.split("  ")[-1].strip() for line in explained.split("timeline")[1].splitlines()]
    assert [stage for stage in stages if stage in worker_stages] == worker_stages, explained


def test_kv_streams_layer_by_layer_and_prefixes_are_reused_across_instances(
    tiny_model_dir, tiny_llm
):
    prefix = "The same long system prompt, " * 6
    first, second = prefix + "first question", prefix + "second one"
    with running_cluster(
        tiny_model_dir,
        **{
            "prefill.replicas": 2,
            "decode.replicas": 1,
            "router.policy": "round_robin",
            "engine.prefill_chunk_size": 16,
        },
    ) as (cluster, client):
        a = client.complete(first, max_tokens=6, temperature=0.0, request_id="first")
        b = client.complete(second, max_tokens=6, temperature=0.0, request_id="second")
        # A long prompt in 16-token chunks: about 90 prefill steps, long enough that its
        # first layer reaches decode while the prefill is still computing, even on a busy CPU.
        client.complete("z" * 1500, max_tokens=2, request_id="long")
        placed = {rid: _placement(client.explain(rid)) for rid in ("first", "second", "long")}
        published = ray.get(worker(cluster, placed["long"][0]).publish_time.remote("long"))
        received = ray.get(worker(cluster, "decode-2").receive_timings.remote("long"))
        loader = counters(cluster, placed["second"][0])
        # The prefill worker copied its layers into its node's store through shared memory,
        # and the decode worker copied them out of there or out of the prefill worker's pages.
        shared_writes = counters(cluster, placed["long"][0])["num_shared_writes"]
        decode = counters(cluster, "decode-2")
        copies = decode["num_shared_reads"] + decode["num_page_copies"]
        # ... and told the decode worker of each layer and of the first token itself.
        notices = counters(cluster, placed["long"][0])["num_direct_notices"]
        direct_receives = counters(cluster, "decode-2")["num_direct_receives"]
        with pytest.raises(ServerError) as unknown:
            client.explain("never-sent")
    assert placed["first"][0] != placed["second"][0], "round robin alternates prefill workers"
    assert placed["second"][1] == "decode-2"
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND.name
    assert received.first_layer_received_at < published
    assert shared_writes > 0 and copies > 0
    assert notices > 0 and direct_receives == 3
    # The second prefill worker loaded the first one's prefix out of the store's arena.
    loaded = loader["num_loaded_tokens"]
    assert loaded == (len(prefix) // 16) * 16
    assert loader["num_arena_loads"] == tiny_llm.engine.model_config.num_layers
    assert b.usage.cached_tokens == loaded
    assert [a.token_ids, b.token_ids] == _expected(tiny_llm, [first, second], 6)


def _placement(explanation: str) -> tuple[str, str]:
    """(prefill, decode) worker names from `halfmoon status --explain` text."""
    import re

    match = re.search(r"prefill=(\S+) decode=(\S+)", explanation)
    assert match and "predicted ttft" in explanation, explanation
    return match.group(1), match.group(2)


def test_cancel_and_deadline_release_every_page_and_lease(tiny_model_dir):
    with running_cluster(tiny_model_dir, **{"engine.max_num_seqs": 4}) as (cluster, client):
        stream = client.generate("cancel me " * 5, max_tokens=400, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
        with pytest.raises(ServerError) as caught:
            client.complete("deadline " * 5, max_tokens=1500, ignore_eos=True, timeout=0.5)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED.name
        client.complete("after", max_tokens=2)  # the server still serves
        for name in ("prefill-0", "decode-1"):
            wait_until(lambda n=name: counters(cluster, n)["num_used_pages"] == 0)
            assert counters(cluster, name)["num_running"] == 0
        store = next(iter(cluster.stores.values()))
        assert ray.get(store.stats.remote()).host.leased_blocks == 0


@pytest.fixture(scope="module")
def default_cluster(tiny_model_dir):
    """One cluster of the default shape for the tests that only send requests to it."""
    with running_cluster(tiny_model_dir) as started:
        yield started


def test_fifty_concurrent_streams_complete_and_bad_requests_are_invalid(default_cluster):
    _, client = default_cluster
    results = _generate_concurrently(client, [f"request {i}" for i in range(50)], max_tokens=4)
    assert all(len(r.token_ids) == 4 for r in results)
    for bad in ({"max_tokens": 0}, {"top_p": 2.0}, {"temperature": -1.0}):
        with pytest.raises(ServerError) as caught:
            client.complete("fine", **bad)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
        assert next(iter(bad)) in caught.value.message
    with pytest.raises(ServerError) as caught:
        client.complete("")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
    assert len(client.complete("still serving", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_metrics_scrape_counts_what_was_sent(default_cluster):
    import json
    import urllib.request
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    cluster, client = default_cluster
    url = f"http://127.0.0.1:{cluster.ports['metrics_port']}/metrics"

    def scrape() -> dict:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = sample.value
        return samples, text

    finished = ("halfmoon_requests_total", (("outcome", "finished"), ("reason", "")))
    generated = ("halfmoon_generated_tokens_total", ())
    ttfts = ("halfmoon_time_to_first_token_seconds_count", ())
    queried = ("halfmoon_prefix_cache_queried_tokens_total", (("tier", "device"),))
    # The module's cluster has served other tests' requests: count what this test adds.
    before = scrape()[0]
    results = _generate_concurrently(client, [f"metric {i}" for i in range(6)], max_tokens=5)
    with pytest.raises(ServerError):
        client.complete("bad", top_p=3.0)
    wait_until(lambda: scrape()[0].get(finished, 0) == before.get(finished, 0) + 6)
    running = ("halfmoon_worker_running_requests", (("kind", "decode"), ("worker", "decode-1")))
    wait_until(lambda: scrape()[0].get(running) is not None)
    transfer_key = ("halfmoon_kv_transfer_bytes_total", (("path", "store"),))
    wait_until(lambda: scrape()[0].get(transfer_key, 0) > 0)
    samples, text = scrape()
    added = {key: samples.get(key, 0) - before.get(key, 0) for key in (generated, ttfts, queried)}
    assert added[generated] == sum(len(r.token_ids) for r in results)
    assert added[ttfts] == 6
    assert added[queried] == sum(r.usage.prompt_tokens for r in results)
    dashboard = json.loads(Path("deploy/grafana/halfmoon.json").read_text())
    names = _dashboard_metric_names(dashboard)
    missing = [n for n in names if n not in text]
    assert not missing, f"dashboard queries metrics the live /metrics lacks: {missing}"


def _dashboard_metric_names(dashboard: dict) -> set[str]:
    import re

    names = set()
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            # halfmoon_engine_* are on each worker's own /metrics (test_metrics_live.py).
            names |= set(re.findall(r"halfmoon_(?!engine_)[a-z_]+", target.get("expr", "")))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_the_prefill_token_is_streamed_before_the_hand_off_to_decode(tiny_model_dir, tiny_llm):
    prompt = "The first token comes from the prefill worker " * 3
    settings = {"router.bypass_threshold_tokens": 0}
    with running_cluster(tiny_model_dir, **settings) as (_, client):
        stream = client.generate(prompt, max_tokens=6, temperature=0.0, logprobs=2)
        with stream:
            deltas = list(stream)
        explained = client.explain(stream.request_id)
    expected = tiny_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    first = deltas[0]
    assert first.token_ids == expected.token_ids[:1] and first.text == ""
    assert [lp.token_id for lp in first.logprobs] == expected.token_ids[:1]
    assert sum((d.token_ids for d in deltas), []) == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in logprobs] == expected.token_ids
    assert all(len(lp.top) == 2 for lp in logprobs)
    assert deltas[-1].usage.completion_tokens == 6
    # The router's timeline of the request, in the order things happened.
    stages = [line.split("  ")[-1].strip() for line in explained.split("timeline")[1].splitlines()]
    in_order = [
        "tokenized",
        "routed",
        "prefill compute began",
        "prefill compute ended",
        "prefill call returned on the worker",
        "prefill returned",
        "first token out",
        "decode worker: call began on the worker",
        "decode worker: first output left the worker",
        "first decode output",
        "released",
    ]
    assert [stage for stage in stages if stage in in_order] == in_order, explained
    assert {"decode pages reserved", "prefill call began on the worker"} <= set(stages)
