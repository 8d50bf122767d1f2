"""Autoscaling on the live local cluster: pools grow under a burst and shrink when idle,
with no failed request."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_kit import running_cluster

from halfmoon.cluster.control.controller import Controller

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def _policy(signal: str, target: float) -> dict:
    return {
        "kind": "target",
        "signal": signal,
        "target": target,
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0.3,
        "downscale_delay_s": 1.0,
        "cooldown_s": 0.5,
        "max_step": 1,
    }


def _burst(client, prompts, max_tokens, failures):
    def run(prompt):
        try:
            out = client.complete(prompt, max_tokens=max_tokens, ignore_eos=True)
            if len(out.token_ids) != max_tokens:
                failures.append(f"short output for {prompt[:10]!r}")
        except Exception as error:  # noqa: BLE001 - every failure is collected and asserted
            failures.append(repr(error))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def _drive(controller: Controller, pool: str, threads, until_size: int, timeout_s: float) -> int:
    """Run autoscaling rounds while the burst runs, then until `pool` is back to `until_size`."""
    biggest = len(controller.active(pool))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        controller.autoscale()
        biggest = max(biggest, len(controller.active(pool)))
        busy = any(t.is_alive() for t in threads)
        if (
            not busy
            and biggest >= 2
            and len(controller.active(pool)) == until_size
            and not controller.draining
        ):
            return biggest
        time.sleep(0.2)
    raise AssertionError(f"{pool} pool did not grow and shrink back: history {controller.history}")


@pytest.mark.parametrize(
    ("pool", "signal", "target", "prompt_len", "max_tokens", "count"),
    [
        ("prefill", "waiting_tokens", 64.0, 600, 2, 24),
        ("decode", "running_requests", 2.0, 20, 120, 10),
    ],
)
def test_pool_grows_under_burst_and_shrinks_when_idle(
    tiny_model_dir, pool, signal, target, prompt_len, max_tokens, count
):
    overrides = {
        f"autoscaling.{pool}": _policy(signal, target),
        "engine.num_pages": 512,
        "engine.max_num_batched_tokens": 64,
        "engine.prefill_chunk_size": 32,
    }
    with running_cluster(tiny_model_dir, **overrides) as (cluster, client):
        controller = Controller(cluster)
        failures: list[str] = []
        prompts = [f"{i} " + "y" * prompt_len for i in range(count)]
        threads = _burst(client, prompts, max_tokens, failures)
        biggest = _drive(controller, pool, threads, until_size=1, timeout_s=120)
        for t in threads:
            t.join()
        assert biggest == 2
        assert failures == []
        assert len(client.complete("after scaling", max_tokens=3, ignore_eos=True).token_ids) == 3


@pytest.mark.timeout(300)
def test_slo_planner_sizes_a_pool_from_the_live_cost_model(tiny_model_dir):
    # No prefill_tokens_per_s: each round plans from the router's cost model as it stands
    # (measured at start, calibrated, refit online), from the traffic of the last 3 s.
    planner = {
        "kind": "slo_planner",
        "ttft_s": 1.0,
        "headroom": 4.0,
        "window_s": 3.0,
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 1.0,
        "cooldown_s": 0.5,
        "max_step": 1,
    }
    overrides = {"autoscaling.prefill": planner, "engine.num_pages": 512, "router.profile": None}
    with running_cluster(tiny_model_dir, **overrides) as (cluster, client):
        controller = Controller(cluster)
        failures: list[str] = []
        threads = _burst(client, [f"{i} " + "y" * 600 for i in range(16)], 2, failures)
        biggest = _drive(controller, "prefill", threads, until_size=1, timeout_s=150)
        assert biggest == 2
        assert failures == []
        (_, _, _, _, up), *_, (_, _, _, _, down) = controller.history
        assert up.startswith("scale up 1 -> 2: planner: ")
        # Down once the burst is over, or (on a loaded host) once its tail's rate needs one.
        assert down.startswith("scale down 2 -> 1: planner: ")
