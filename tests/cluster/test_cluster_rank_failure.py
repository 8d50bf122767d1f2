"""A tensor-parallel worker one of whose ranks dies: the request in flight fails at once (no
hang), the worker says it cannot serve, and the controller replaces the whole group of ranks by
a new worker that serves the offline engine's outputs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import ray
from cluster_kit import running_cluster, wait_until

from halfmoon.cluster.control.controller import Controller
from halfmoon.cluster.frontend.grpc_errors import ServerError
from halfmoon.engine import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

DECODE_T2 = {"decode.tensor_parallel_size": 2, "router.bypass_threshold_tokens": 0}
PROMPTS = ["Hello there", "The quick brown fox"]


def _rank_pids(actor) -> list[int]:
    """Rank 0's process (the actor's) and then the other ranks' subprocesses."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda w: [os.getpid(), *(p.pid for p in w.engine.rank_processes)]
        )
    )


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_killed_rank_fails_its_request_and_the_controller_replaces_the_group(
    tiny_model_dir, tiny_llm
):
    with running_cluster(tiny_model_dir, **DECODE_T2) as (cluster, client):
        controller = Controller(cluster)
        old_pids = _rank_pids(cluster.workers["decode-1"].actor)
        with client.generate("Long", max_tokens=1500, ignore_eos=True) as stream:
            next(stream)  # decoding on both ranks now
            os.kill(old_pids[1], signal.SIGKILL)
            with pytest.raises(ServerError, match="rank 1"):
                list(stream)
        wait_until(lambda: "decode-1" in controller.check_health(), 60)
        (new,) = controller.pending
        wait_until(lambda: new in controller.register_started(), 120)
        new_pids = _rank_pids(cluster.workers[new].actor)
        results = [client.complete(p, max_tokens=8, temperature=0.0) for p in PROMPTS]
        wait_until(lambda: not any(map(_running, old_pids)), 30)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    assert [r.token_ids for r in results] == [
        o.token_ids for o in tiny_llm.generate(PROMPTS, params)
    ]
    assert len(new_pids) == 2 and not set(new_pids) & set(old_pids)
