"""Every request's resources come back on every exit path, one request cannot harm another,
and the cluster's health and routing follow its workers' lives (issue 15, findings 1, 2, 4, 5)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import grpc
import pytest
import ray
from cluster_kit import counters, running_cluster, worker
from grpc_health.v1 import health_pb2, health_pb2_grpc

from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError
from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.worker.errors import WorkerError
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.engine import SamplingParams
from halfmoon.kvstore.keys import block_keys
from halfmoon.prefill_worker.task import PrefillTask

pytestmark = pytest.mark.usefixtures("ray_session")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Every prompt goes through a prefill worker and a decode worker (no short-prompt bypass).
DISAGGREGATED = {"router.bypass_threshold_tokens": 0, "engine.num_pages": 512}


def _expected(tiny_llm, prompts, max_tokens, **penalties):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **penalties)
    return [out.token_ids for out in tiny_llm.generate(prompts, params)]


# Penalties over the generated tokens: a migrated stream must count what it generated before.
PENALTIES = {"frequency_penalty": 0.4, "presence_penalty": 0.3}


def _wait_until(condition, timeout_s: float = 60.0, what: str = "condition"):
    """Poll a condition the cluster reaches asynchronously (releases happen after the RPC)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.1)
    return value


def _idle(cluster, client_info) -> dict:
    """What the cluster still holds for requests; all zero once every request is released."""
    details = client_info().details
    held = {"in_flight": details["in_flight"]}
    for name in cluster.workers:
        stats = counters(cluster, name)
        held[f"{name} used pages"] = stats["num_used_pages"]
        held[f"{name} running"] = stats["num_running"] + stats["num_waiting"]
        held[f"{name} receiving"] = stats.get("num_receiving", 0)
        held[f"{name} router reservation"] = details["workers"][name].get("reserved_kv_tokens", 0)
    for store in cluster.stores.values():
        held["leased blocks"] = ray.get(store.stats.remote()).host.leased_blocks
    return held


async def _one(client: AsyncClient, i: int, rng: random.Random) -> str:
    """One request that finishes, is cancelled, or runs out of deadline at a random point; or
    is turned away by admission's queue bound, one more exit path that must hold nothing."""
    prompt = f"request {i} " + "w" * rng.randrange(10, 120)
    fate = rng.choice(["finish", "finish", "cancel", "deadline"])
    try:
        return await _meet(client, prompt, fate, rng)
    except ServerError as error:
        if error.code != "RESOURCE_EXHAUSTED":
            raise
        return "rejected"


async def _meet(client: AsyncClient, prompt: str, fate: str, rng: random.Random) -> str:
    if fate == "finish":
        await client.complete(prompt, max_tokens=rng.randrange(1, 12), temperature=0.0)
        return fate
    if fate == "deadline":
        try:
            await client.complete(prompt, max_tokens=60, timeout=rng.uniform(0.01, 1.5))
        except ServerError as error:
            if error.code == "RESOURCE_EXHAUSTED":
                raise
            assert error.code == "DEADLINE_EXCEEDED", error
        return fate
    stream = client.generate(prompt, max_tokens=60, ignore_eos=True)
    reads = rng.randrange(0, 4)  # 0: cancelled before the first token
    await asyncio.sleep(rng.uniform(0.0, 0.3) if reads == 0 else 0.0)
    async for _ in stream:
        reads -= 1
        if reads <= 0:
            break
    stream.cancel()
    return fate


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cancels_and_deadlines_at_random_points_leave_nothing_held(tiny_model_dir):
    rng = random.Random(15)
    num_requests = int(os.environ.get("HALFMOON_LEAK_REQUESTS", "150"))  # 1,000 for the goal
    # Admission off lets all 150 in (with the default queue bound about half would be turned
    # away, the `rejected` fate, which holds nothing either: 83 of 150 when last run). On a
    # slow 2-core run the last prefills start more than `store.get_timeout_s` (30 s) after
    # their decode reads began: the reads wait for them.
    settings = {"engine.num_pages": 512, "router.admission": "none"}
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        address = client.address

        async def run() -> list:
            async with AsyncClient(address) as aclient:
                return await asyncio.gather(*[_one(aclient, i, rng) for i in range(num_requests)])

        started = time.monotonic()
        fates = asyncio.run(run())
        ended = time.monotonic()
        # With no request sent, the idle workers give back what aborts left (issue 35: within
        # 2 s of the last answer; 60 s here for a slowed machine, the figure is printed).
        deadline = ended + 60
        while any((held := _idle(cluster, client.server_info)).values()):
            assert time.monotonic() < deadline, f"still held after 60 s: {held}"
            time.sleep(0.2)
        idle_s = time.monotonic() - ended
        assert len(client.complete("after", max_tokens=3, ignore_eos=True).token_ids) == 3
    counts = {f: fates.count(f) for f in sorted(set(fates))}
    print(f"\nleak test: {counts} in {ended - started:.1f} s; idle {idle_s:.2f} s after the last")


@pytest.fixture(scope="module")
def default_cluster(tiny_model_dir):
    """One cluster of the default shape for the tests that only send requests to it."""
    with running_cluster(tiny_model_dir) as started:
        yield started


@pytest.mark.timeout(600)
def test_a_live_duplicate_id_is_refused_and_the_first_request_goes_on(default_cluster, tiny_llm):
    prompt = "The first one keeps its id " * 3
    _, client = default_cluster
    stream = client.generate(prompt, max_tokens=40, temperature=0.0, request_id="dup")
    tokens = list(next(iter(stream)).token_ids)
    with pytest.raises(ServerError) as caught:
        client.complete("the intruder", max_tokens=3, request_id="dup")
    tokens += [t for delta in stream for t in delta.token_ids]
    again = client.complete(prompt, max_tokens=40, temperature=0.0, request_id="dup")
    aborted = client.generate(prompt, max_tokens=400, ignore_eos=True, request_id="gone")
    next(iter(aborted))
    assert client.abort("gone") is True
    rest = list(aborted)
    assert client.abort("gone") is False
    assert rest[-1].finish_reason == "abort"
    assert caught.value.code == "ALREADY_EXISTS"
    assert "dup" in caught.value.message
    assert tokens == _expected(tiny_llm, [prompt], 40)[0]
    assert again.token_ids == tokens  # the id is free again once the first one ended


@pytest.mark.timeout(600)
def test_max_tokens_beyond_the_context_is_invalid_at_once(default_cluster):
    _, client = default_cluster
    context = client.model_info().max_model_len
    started = time.monotonic()
    with pytest.raises(ServerError) as caught:
        client.complete("hello", max_tokens=2**31, timeout=60)
    elapsed_s = time.monotonic() - started
    with client.generate("hello", max_tokens=context - 5) as fits:  # the most that fits
        first = next(iter(fits))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert str(context) in caught.value.message and "max_tokens" in caught.value.message
    assert f"at most {context - 5} tokens" in caught.value.message  # "hello" is 5 tokens
    assert len(first.token_ids) == 1
    print(f"\nmax_tokens=2**31 refused in {elapsed_s * 1000:.0f} ms")


@pytest.mark.timeout(600)
def test_an_abort_that_overtakes_its_reserve_or_prefill_still_frees_them(default_cluster):
    token_ids = list(range(10, 90))
    params = SamplingParams(max_tokens=4)
    cluster, client = default_cluster
    _wait_until(lambda: not any(_idle(cluster, client.server_info).values()), 30, "idle")
    decode, prefill = worker(cluster, "decode-1"), worker(cluster, "prefill-0")
    store_name = ray.get(prefill.store_name.remote())
    assert ray.get(decode.abort.remote("late", "ticket-1")) is False
    info = ray.get(prefill.info.remote())
    keys = block_keys(info.root_key, token_ids, info.block_size)
    task = DecodeTask("late", token_ids, params, keys, store_name=store_name, ticket="ticket-1")
    reserve = decode.reserve.remote(task)
    late_reserve = ray.get(reserve)
    assert ray.get(prefill.abort.remote("late", "ticket-1")) is False
    late_task = PrefillTask("late", token_ids, params, keys, ticket="ticket-1")
    late_prefill = ray.get(prefill.prefill.remote(late_task))
    held = [counters(cluster, name)["num_used_pages"] for name in ("decode-1", "prefill-0")]
    # The same id with a new ticket (a later request reusing it) is served as usual.
    task = DecodeTask("late", token_ids, params, keys, store_name=store_name, ticket="ticket-2")
    pages = ray.get(decode.reserve.remote(task))
    assert ray.get(decode.abort.remote("late", "ticket-2")) is True
    # The counters are the engine's as of the end of its last step or call (never waiting for
    # the one in progress), published just after the abort's answer: under load, a moment later.
    _wait_until(lambda: counters(cluster, "decode-1")["num_used_pages"] == 0, 10, "pages freed")
    freed = counters(cluster, "decode-1")["num_used_pages"]
    assert late_reserve == WorkerError("CANCELLED", "request late was aborted")
    assert late_prefill == WorkerError("CANCELLED", "request late was aborted")
    assert held == [0, 0]
    assert pages == 5 and freed == 0  # 80 tokens in 16-token pages


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_a_killed_worker_loses_no_request_and_streams_go_on(tiny_model_dir, tiny_llm, pool):
    prompts = [f"{i} " + "k" * 150 for i in range(24)]
    max_tokens = 24
    settings = {
        **DISAGGREGATED,
        "router.pool_wait_s": 300,
        "health.interval_s": 0.5,
        "health.timeout_s": 60,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        address = client.address
        # Health follows the workers every 0.5 s: SERVING once both pools have registered.
        _wait_until(lambda: _health(address) == SERVING, 30, "SERVING at start")
        victim = next(w for w in cluster.workers.values() if w.kind == pool)
        results: list = [None] * len(prompts)
        deltas = [0] * len(prompts)

        async def request(aclient, i):
            try:
                stream = aclient.generate(
                    prompts[i], max_tokens=max_tokens, temperature=0.0, **PENALTIES
                )
                tokens = []
                async for delta in stream:
                    deltas[i] += 1
                    tokens += delta.token_ids
                results[i] = tokens
            except ServerError as error:
                results[i] = error

        async def load():
            async with AsyncClient(address) as aclient:
                await asyncio.gather(*[request(aclient, i) for i in range(len(prompts))])

        loader = threading.Thread(target=lambda: asyncio.run(load()))
        loader.start()
        _wait_until(lambda: sum(d >= 2 for d in deltas) >= 3, 300, "some streams under way")
        pid = _pid(victim.actor)
        streaming = sum(1 for i, d in enumerate(deltas) if d >= 2 and results[i] is None)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: _health(address) == NOT_SERVING, 30, "NOT_SERVING")
        not_serving_s = time.monotonic() - killed_at
        stop = threading.Event()
        controller = Controller(cluster)
        watcher = threading.Thread(target=controller.run, args=(stop,))
        watcher.start()
        try:
            _wait_until(lambda: _health(address) == SERVING, 300, "SERVING again")
            serving_s = time.monotonic() - killed_at
            loader.join(timeout=600)
        finally:
            stop.set()
            watcher.join()
        after = client.complete(prompts[0], max_tokens=max_tokens, temperature=0.0, **PENALTIES)
        # Pages the prefill workers lent to a killed decode worker went back when its
        # connection ended (and none are held for the requests that completed).
        prefills = [name for name, w in cluster.workers.items() if w.kind == "prefill"]
        _wait_until(
            lambda: all(counters(cluster, n)["num_lent_pages"] == 0 for n in prefills),
            30,
            "lent pages given back",
        )
    expected = _expected(tiny_llm, prompts, max_tokens, **PENALTIES)
    # A request that had streamed nothing is retried; one that had (its decode worker died
    # mid-stream) migrates: its stream goes on with no gap and no repeated token, and its
    # penalties count the tokens generated before the migration.
    assert results == expected
    assert after.token_ids == expected[0]
    assert controller.num_restarts == 1
    print(
        f"\nkill -9 {victim.name}: {len(prompts)}/{len(prompts)} completed, outputs as "
        f"undisturbed ({streaming} were streaming when it died); NOT_SERVING after "
        f"{not_serving_s:.2f} s, SERVING again after {serving_s:.1f} s"
    )
