"""The controller's autoscaling rounds against a stand-in router actor: each round plans from
the router's cost model as it stands, and a round the router does not answer is skipped."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import pytest
import ray

from halfmoon.cluster.config import ClusterConfig, load_config
from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.control.launcher import WorkerHandle
from halfmoon.router.cost_model import CostModel
from halfmoon.router.profile import PROFILE_DIR, Profile, load_profile

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

# 20 req/s of 1000-token prompts; the planners below have no tokens/s figure of their own.
TRAFFIC = {"request_rate_per_s": 20.0, "mean_input_tokens": 1000.0, "mean_output_tokens": 10.0}
PREFILL_PLANNER = {
    "kind": "slo_planner",
    "ttft_s": 0.5,
    "headroom": 1.0,
    "max_replicas": 8,
    "max_step": 8,
    "upscale_delay_s": 0.0,
    "cooldown_s": 0.0,
}


def _profile(prefill_per_token_s: float, decode_const_s: float = 0.0) -> Profile:
    cost = CostModel((0.0, prefill_per_token_s, 0.0, 0.0), (decode_const_s, 1e-4, 0.0))
    return dataclasses.replace(load_profile(PROFILE_DIR / "cpu-tiny.yaml"), cost=cost)


@ray.remote(num_cpus=0)
class StandInRouter:
    """Answers an autoscaling round's router calls with fixed traffic and a settable profile."""

    def __init__(self, profile: Profile) -> None:
        self.current = profile
        self.silent_s = 0.0

    def set_profile(self, profile: Profile) -> None:
        self.current = profile

    def go_silent(self, seconds: float) -> None:
        self.silent_s = seconds

    def pool_signals(self, window_s: float = 60.0) -> dict[str, dict[str, float]]:
        time.sleep(self.silent_s)
        return {"prefill": TRAFFIC, "decode": TRAFFIC}

    def profile(self) -> Profile:
        return self.current

    def update_pool(self, pool: str, desired: int, actual: int) -> None:
        pass

    def in_flight(self, name: str) -> int:
        return 0


@ray.remote(num_cpus=0)
class StandInWorker:
    def ping(self) -> None:
        pass


@dataclass
class StandInCluster:
    """The part of a Cluster an autoscaling round uses: one worker per pool to start with."""

    config: ClusterConfig
    router: ray.actor.ActorHandle
    workers: dict[str, WorkerHandle] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in self.pools:
            self.add_worker(kind)

    @property
    def pools(self) -> dict[str, None]:
        return {"prefill": None, "decode": None}

    def add_worker(self, kind: str, wait: bool = True) -> WorkerHandle:
        name = f"{kind}-{len(self.workers)}"
        worker = self.workers[name] = WorkerHandle(name, kind, StandInWorker.remote())
        return worker

    def register_worker(self, worker: WorkerHandle) -> None:
        pass


def _controller(profile: Profile, **policies: dict) -> Controller:
    overrides = {f"autoscaling.{pool}": policy for pool, policy in policies.items()}
    config = load_config(None, {**overrides, "health.timeout_s": 0.5})
    router = StandInRouter.remote(profile)
    ray.get(router.profile.remote())  # started: only a fault below keeps it from answering
    return Controller(StandInCluster(config, router))


def test_each_round_plans_from_the_router_cost_model_as_it_stands():
    # 20,000 prompt tokens/s. At 1e-5 s/token one replica prefills 100,000 tokens/s at <= 98%
    # utilization: 1 replica. Refit to 1e-4 s/token: 10,000 tokens/s at <= 80%: 3 replicas.
    controller = _controller(_profile(1e-5), prefill=PREFILL_PLANNER)
    controller.autoscale(now=0.0)
    assert controller.history == []
    ray.get(controller.cluster.router.set_profile.remote(_profile(1e-4)))
    controller.autoscale(now=1.0)
    [(_, pool, actual, desired, reason)] = controller.history
    assert (pool, actual, desired) == ("prefill", 1, 3)
    assert "utilization of 1e+04 tokens/s per replica" in reason
    assert len(controller.active("prefill")) == 3


@pytest.mark.parametrize("fault", ["dead", "silent"])
def test_a_round_the_router_does_not_answer_is_logged_and_skipped(fault, caplog):
    controller = _controller(_profile(1e-4), prefill=PREFILL_PLANNER)
    router = controller.cluster.router
    if fault == "dead":
        ray.kill(router, no_restart=True)
    else:
        ray.get(router.go_silent.remote(5.0))
    with caplog.at_level(logging.WARNING):
        controller.autoscale(now=0.0)
    assert "autoscaling round skipped: the router did not answer" in caplog.text
    assert controller.history == []
    assert len(controller.active("prefill")) == 1


def test_a_pool_whose_plan_fails_is_skipped_and_the_other_still_scales(caplog):
    # One decode step takes 0.1 s, over the 0.05 s TBT target: decode cannot be planned.
    decode = {"kind": "slo_planner", "tbt_s": 0.05, "upscale_delay_s": 0.0}
    controller = _controller(_profile(1e-4, 0.1), prefill=PREFILL_PLANNER, decode=decode)
    with caplog.at_level(logging.WARNING):
        controller.autoscale(now=0.0)
    assert "autoscaling decode skipped this round: one decode step takes" in caplog.text
    assert [entry[1:4] for entry in controller.history] == [("prefill", 1, 3)]
