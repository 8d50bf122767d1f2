"""Liveness that tells busy from dead: a worker whose pings time out is not replaced until it
has been silent for `health.unresponsive_s`; one whose process dies is replaced at once."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from cluster_kit import running_cluster, worker
from grpc_testkit import wait_for

from halfmoon.cluster.control.controller import Controller

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]


def _hold_event_loops(cluster, seconds: float) -> list:
    """Make every worker truly silent for `seconds`: a synchronous call on an async actor
    blocks its event loop, so its pings queue behind it (as behind a long stall)."""
    return [
        w.actor.__ray_call__.remote(lambda _, s=seconds: time.sleep(s))
        for w in cluster.workers.values()
    ]


def test_a_silent_worker_is_kept_until_it_has_been_unresponsive_too_long(tiny_model_dir):
    settings = {"health.timeout_s": 0.5, "health.unresponsive_s": 3.0}
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        controller = Controller(cluster)
        held = _hold_event_loops(cluster, 2.0)
        time.sleep(0.2)
        assert controller.check_health() == []  # silent, not dead: nothing replaced
        assert set(controller.silent_since) == set(cluster.workers)
        ray.get(held)
        client.complete("still serving", max_tokens=2)  # the kept workers serve on
        assert controller.check_health() == [] and controller.silent_since == {}
        _hold_event_loops(cluster, 30.0)  # now a stall past the bound
        time.sleep(0.2)
        assert controller.check_health() == []
        time.sleep(3.0)
        replaced = controller.check_health()  # silent past the bound now: replaced
        assert sorted(replaced) == ["decode-1", "prefill-0"]
        assert controller.num_restarts == 2
        assert wait_for(lambda: controller.register_started() or not controller.pending, 120)


def test_a_killed_worker_is_replaced_on_the_next_check(tiny_model_dir):
    with running_cluster(tiny_model_dir, **{"health.unresponsive_s": 600.0}) as (cluster, _):
        controller = Controller(cluster)
        pid = ray.get(worker(cluster, "prefill-0").__ray_call__.remote(lambda _: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: "prefill-0" in controller.check_health(), 60)
        assert controller.num_restarts == 1


def test_a_worker_whose_device_failed_is_replaced_and_the_next_request_served(tiny_model_dir):
    """A step that left the device unusable (a sticky CUDA error: engine/errors.py) makes the
    worker fail its health check though its process answers; the controller replaces it."""
    with running_cluster(tiny_model_dir, **{"health.unresponsive_s": 600.0}) as (cluster, client):
        controller = Controller(cluster)

        def fail_its_device(actor) -> None:
            from halfmoon.engine.errors import DeviceFailedError

            actor._engine().failed = DeviceFailedError("the engine's device failed in a step")

        ray.get(worker(cluster, "decode-1").__ray_call__.remote(fail_its_device))
        assert wait_for(lambda: "decode-1" in controller.check_health(), 60)
        assert controller.num_restarts == 1 and "decode-1" not in cluster.workers
        assert wait_for(lambda: controller.register_started() or not controller.pending, 120)
        done = client.complete("Served after the replacement", max_tokens=4, temperature=0.0)
        assert len(done.token_ids) == 4
