"""`halfmoon bench rdt` on real actors: every CPU path delivers exactly the bytes sent."""

from __future__ import annotations

import json

import pytest
import ray
import torch

from halfmoon.bench.probes import rdt as bench_rdt
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.store_node import start_store_node

LAYOUT = KvLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=32)


@pytest.mark.timeout(120)
def test_store_shared_object_and_gloo_deliver_the_exact_bytes_sent(ray_session) -> None:
    store = start_store_node(LAYOUT, StoreConfig(host_capacity_bytes=1 << 24), name="test-rdt")
    pair = bench_rdt.start_pair(LAYOUT, max_blocks=8, device="cpu", store=store, backend="gloo")
    try:
        for path in ("store", "shared", "object", "gloo"):
            ray.get(pair.receiver.clear.remote())
            ray.get(pair.sender.request.remote(path, 5))
            sent = ray.get(pair.sender.sent.remote(5))
            got = ray.get(pair.receiver.received.remote(5))
            assert len(got) == LAYOUT.num_layers
            for a, b in zip(sent, got, strict=True):
                assert a.shape == b.shape == (5, *LAYOUT.page_shape)
                assert a.k.abs().sum() > 0  # random data, so zeros would mean nothing came
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v), path
    finally:
        for actor in (pair.sender, pair.receiver, store):
            ray.kill(actor)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_reports_every_cpu_path_intact_and_skips_the_cuda_ones(ray_session, capsys) -> None:
    argv = ["--tokens", "40,64", "--requests", "2", "--json"]
    assert bench_rdt.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    got = [(row["num_tokens"], row["path"]) for row in summary["rows"]]
    assert got == [(n, p) for n in (40, 64) for p in ("store", "shared", "object", "gloo")]
    assert all(row["intact"] for row in summary["rows"])
    assert sorted(summary["skipped"]) == ["cuda_ipc", "nccl"]
    # 40 tokens fill 3 blocks of the tiny model's 4 layers x 2 KV heads of 32 x fp16.
    assert summary["rows"][0]["request_bytes"] == 3 * 4 * 2 * 16 * 2 * 32 * 2


def test_cuda_runs_ipc_on_one_gpu_and_nccl_only_across_two() -> None:
    one_gpu, skipped = bench_rdt.plan_paths("cuda", 1)
    assert one_gpu == ["store", "shared", "object", "gloo", "cuda_ipc"]
    assert list(skipped) == ["nccl"] and "needs >= 2" in skipped["nccl"]
    assert bench_rdt.plan_paths("cuda", 2) == (list(bench_rdt.PATHS), {})
    cpu, skipped = bench_rdt.plan_paths("cpu", 0)
    assert cpu == ["store", "shared", "object", "gloo"] and sorted(skipped) == ["cuda_ipc", "nccl"]
