"""The router is not a single point of failure: kill -9 of the router actor under 50 streaming
requests, and the controller (as `halfmoon serve` runs it) ends what the dead router had in
flight on every worker, starts a new router on the same ports from the last profile, and its
prefix index from the workers' and stores' snapshots (issue 49's goals); then the new router
hangs, and is replaced in turn once silent for `health.unresponsive_s`."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import urllib.request

import pytest
import ray
from cluster_kit import running_cluster

from halfmoon.bench.chaos.leaks import held
from halfmoon.cluster.client.grpc_client import AsyncClient, Client, ServerError
from halfmoon.cluster.control.controller import Controller

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_session")]

SETTINGS = {
    "mode": "disaggregated",
    "router.bypass_threshold_tokens": 0,  # every prompt through the prefill worker
    "engine.num_pages": 1024,
    "health.interval_s": 0.5,
    "health.timeout_s": 5.0,
    "health.unresponsive_s": 8.0,  # a hung router is replaced after 8 s of silence
}
STREAMS = 50
CACHED_PROMPT = "the prefix cached before the kill " * 8  # ~270 tokens: 16 blocks and more


def _wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.05)
    return value


def _served(address: str) -> bool:
    """A new request served end to end (a fresh channel: no reconnect backoff in the way)."""
    try:
        with Client(address) as client:
            return bool(client.complete("back again", max_tokens=2, timeout=5).token_ids)
    except ServerError:
        return False


class Streams:
    """STREAMS streaming requests on a thread of their own; when each ended and how."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.deltas = [0] * STREAMS
        self.outcomes: list = [None] * STREAMS
        self.ended_at = [0.0] * STREAMS
        self.thread = threading.Thread(target=lambda: asyncio.run(self._all()))

    async def _all(self) -> None:
        async with AsyncClient(self.address) as client:
            await asyncio.gather(*(self._one(client, i) for i in range(STREAMS)))

    async def _one(self, client: AsyncClient, i: int) -> None:
        try:
            stream = client.generate(f"{i} " + "s" * 96, max_tokens=200, ignore_eos=True)
            async for _ in stream:
                self.deltas[i] += 1
            self.outcomes[i] = "completed"
        except ServerError as error:
            self.outcomes[i] = error
        self.ended_at[i] = time.monotonic()

    def streaming(self) -> int:
        return sum(1 for d, o in zip(self.deltas, self.outcomes, strict=True) if d and o is None)


def test_a_killed_or_hung_router_is_replaced_on_its_ports_and_leaves_nothing_held(tiny_model_dir):
    with running_cluster(tiny_model_dir, **SETTINGS) as (cluster, client):
        address, ports = client.address, dict(cluster.ports)
        client.complete(CACHED_PROMPT, max_tokens=2, request_id="before")
        before = re.search(r"cached=(\d+)", client.explain("before"))
        streams = Streams(address)
        streams.thread.start()
        _wait_until(lambda: streams.streaming() >= 20, 120, "20 streams under way")
        pid = ray.get(cluster.router.__ray_call__.remote(lambda _: os.getpid()))
        in_flight = streams.streaming()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        controller, stop = Controller(cluster), threading.Event()
        watcher = threading.Thread(target=controller.run, args=(stop,))
        watcher.start()
        try:
            _wait_until(lambda: _served(address), 60, "a new request served")
            served_s = time.monotonic() - killed_at
            streams.thread.join(timeout=60)
            _wait_until(lambda: not any(held(cluster).values()), 30, "nothing held")
            held_s = time.monotonic() - killed_at
        finally:
            stop.set()
            watcher.join()
        client_after = Client(address)
        client_after.complete(CACHED_PROMPT, max_tokens=2, request_id="after")
        after = re.search(r"cached=(\d+)", client_after.explain("after"))
        client_after.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http_port']}/v1/models") as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics") as r:
            assert r.status == 200
        # A router that hangs (its event loop held) is replaced too, once silent too long.
        hung = cluster.router
        hung.__ray_call__.remote(lambda _: time.sleep(120))
        hung_at = time.monotonic()
        stop = threading.Event()
        watcher = threading.Thread(target=controller.run, args=(stop,))
        watcher.start()
        try:
            _wait_until(lambda: cluster.router is not hung and _served(address), 90, "unhung")
            hung_s = time.monotonic() - hung_at
        finally:
            stop.set()
            watcher.join()
    assert cluster.ports == ports  # the same ports
    recovery = controller.recovery
    assert recovery.num_router_restarts == 2 and controller.num_restarts == 0
    assert hung_s <= 30.0
    assert recovery.num_requests_ended >= in_flight  # the workers ended the dead one's requests
    cut = [i for i, o in enumerate(streams.outcomes) if o != "completed"]
    assert cut, "the kill cut no stream"
    # Every cut stream ended with a transport error (retryable), within 15 s of the kill.
    assert all(isinstance(streams.outcomes[i], ServerError) for i in cut)
    assert {streams.outcomes[i].code for i in cut} <= {"UNAVAILABLE", "INTERNAL", "UNKNOWN"}
    ended_s = max(streams.ended_at[i] for i in cut) - killed_at
    assert ended_s <= 15.0
    assert served_s <= 15.0
    assert held_s <= 30.0
    # The new router's index was rebuilt from snapshots: the prefix is a hit, priced as one.
    assert before is not None and after is not None and int(after.group(1)) >= 256
    print(
        f"\nkill -9 router under {STREAMS} streams ({in_flight} streaming, {len(cut)} cut): "
        f"cut streams ended within {ended_s:.2f} s, a new request served after {served_s:.1f} s "
        f"(replacement {recovery.router_restarts_s[0]:.1f} s, {recovery.num_requests_ended} "
        f"ended), nothing held after {held_s:.1f} s; prefix priced cached={after.group(1)} "
        f"tokens after; a hung router replaced and serving {hung_s:.1f} s after its loop stopped"
    )
