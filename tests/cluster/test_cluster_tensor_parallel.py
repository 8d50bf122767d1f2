"""Prefill and decode workers at different tensor-parallel degrees (real Ray actors, their ranks
real processes, gloo on CPU): the KV moves between them whole-head over today's paths, so the
outputs are the offline engine's, and a prefix one degree stored is loaded at the other."""

from __future__ import annotations

import pytest
import ray
from cluster_kit import counters, running_cluster

from halfmoon.engine import SamplingParams

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

PROMPTS = ["Hello there", "x" * 150, "The quick brown fox", "zz" * 40]
PREFIX = "A system prompt that both degrees share, " * 3
# Every prompt is handed from a prefill worker to a decode worker (no short-prompt bypass).
HANDOFF = {"router.bypass_threshold_tokens": 0}


def _expected(tiny_llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [out.token_ids for out in tiny_llm.generate(prompts, params)]


def _swap_prefill_worker(cluster, degree: int) -> str:
    """Replace the prefill worker by one of `degree`; returns the new one's name."""
    (old,) = [name for name in cluster.workers if name.startswith("prefill")]
    pool = cluster.config.prefill.model_copy(update={"tensor_parallel_size": degree})
    cluster.config = cluster.config.model_copy(update={"prefill": pool})
    new = cluster.add_worker("prefill")
    cluster.remove_worker(old)
    return new.name


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["p2d1", "p1d2"])
def test_workers_at_different_degrees_give_the_offline_outputs_and_share_prefixes(
    tiny_model_dir, tiny_llm, prefill_tp, decode_tp
):
    shape = {
        "prefill.tensor_parallel_size": prefill_tp,
        "decode.tensor_parallel_size": decode_tp,
        **HANDOFF,
    }
    with running_cluster(tiny_model_dir, **shape) as (cluster, client):
        results = [client.complete(p, max_tokens=8, temperature=0.0) for p in PROMPTS]
        first = client.complete(PREFIX + "first", max_tokens=6, temperature=0.0)
        (decode,) = [counters(cluster, name) for name in cluster.workers if "decode" in name]
        # The prefix is in the store at `prefill_tp`; a prefill worker of the other degree
        # loads it from there.
        loader = _swap_prefill_worker(cluster, decode_tp)
        second = client.complete(PREFIX + "second", max_tokens=6, temperature=0.0)
        loaded = counters(cluster, loader)
        degrees = {
            w.kind: ray.get(w.actor.info.remote()).tensor_parallel_size
            for w in cluster.workers.values()
        }
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
