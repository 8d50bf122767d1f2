"""Mixture-of-experts checkpoints served disaggregated: each architecture's greedy tokens from
a live 1+1 cluster (KV handed from the prefill worker to the decode worker, the router's cost
model fitted from the MoE model's own start-up profile) equal transformers' on the same prompt
ids."""

from __future__ import annotations

import pytest
import torch
from cluster_kit import counters, running_cluster

from halfmoon.engine.init_model import SHAPES, build_tokenizer, init_model

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPTS = ["Hello there", "x" * 150, "The quick brown fox", "a" * 70]
MAX_TOKENS = 8


def _transformers_tokens(model_dir, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = build_tokenizer()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    return expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_greedy_tokens_of_a_disaggregated_cluster_equal_transformers(tmp_path, arch):
    model_dir = init_model(tmp_path / arch, SHAPES["tiny-moe"], arch=arch)
    handoff = {"prefill.replicas": 1, "decode.replicas": 1, "router.bypass_threshold_tokens": 0}
    with running_cluster(model_dir, **handoff, **{"router.profile": None}) as (cluster, client):
        results = [client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in PROMPTS]
        prefilled = counters(cluster, "prefill-0")
    assert [r.token_ids for r in results] == _transformers_tokens(model_dir, PROMPTS)
    assert prefilled["num_shared_writes"] > 0, "the KV went through the prefill worker"
