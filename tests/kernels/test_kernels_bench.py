"""`halfmoon bench kernels` skips cleanly without CUDA; its workloads run end to end on CPU."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from halfmoon.bench.probes import kernels as bench
from halfmoon.kernels import triton_kernels

# Compiled Triton kernels (on a CUDA host) take CUDA tensors only.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_bench_json_without_cuda_reports_no_device_and_why(no_cuda, capsys):
    assert bench.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"device": None, "skipped": bench.NO_CUDA}


def test_bench_without_cuda_prints_the_reason(no_cuda, capsys):
    assert bench.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_CUDA


def test_bench_workloads_relate_each_kernel_to_peak_and_torch():
    config = bench.BenchConfig(
        decode_batch=2,
        decode_context=40,
        prefill_batch=2,
        prefill_len=24,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        warmup=0,
        iters=1,
    )
    peaks = bench.DevicePeaks(100.0, "test", 10.0, "test")
    calls = []

    def one_call_timer(fn, warmup, iters):
        calls.append(fn())
        return 2.0

    results = bench.run_cases(triton_kernels, config, DEVICE, peaks, one_call_timer)
    kernels = [r.kernel for r in results]
    assert kernels == [
        "paged_decode_attention",
        "prefill_attention",
        "prefill_engine_dispatch",
        "store_kv",
        "gather_pages",
        "scatter_pages",
        "rms_norm",
        "rotary_embedding",
    ]
    assert len(calls) == 2 * len(results)
    ours, batched = calls[4], calls[5]  # the engine's per-run dispatch vs one batched SDPA
    torch.testing.assert_close(ours, batched.transpose(1, 2).flatten(0, 1), atol=2e-3, rtol=2e-3)
    decode = results[0]
    kv_bytes = 2 * 2 * 40 * 2 * 64 * 2 + 2 * (2 * 4 * 64) * 2
    assert decode.achieved == pytest.approx(kv_bytes / 2e-3 / 1e9)
    assert decode.fraction_of_peak == pytest.approx(decode.achieved / 100.0)
    assert decode.speedup_vs_torch == 1.0
    table = bench.format_table("cpu", peaks, results)
    assert "prefill_attention" in table and "TFLOP/s" in table


def test_every_config_field_is_an_option_with_its_default():
    parser = bench.build_parser()
    args = vars(parser.parse_args(["--decode-batch", "3"]))
    assert args.pop("json") is False
    assert bench.BenchConfig(**args) == dataclasses.replace(bench.BenchConfig(), decode_batch=3)
    assert "KV heads (default 8)" in parser.format_help()
