"""`halfmoon bench transfer`: its report and a short live run of all three paths."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from cluster_kit import running_cluster

from halfmoon.bench.probes import transfer as bench_transfer
from halfmoon.bench.probes.transfer import Breakdown

pytestmark = pytest.mark.usefixtures("ray_session")


def test_the_report_gives_each_streaming_path_its_worst_stall(capsys):
    rows = [
        Breakdown(1, True, True, 0.068, 0.065, 0.002, 0.005, 0.003, lent=True, page_copies=4),
        Breakdown(1, True, True, 0.070, 0.065, 0.003, 0.005, 0.005),
        Breakdown(1, True, False, 0.080, 0.065, 0.010, 0.005, 0.015),
        Breakdown(1, False, False, 0.100, 0.070, 0.030, 0.0015, 0.030),
    ]
    assert [r.path for r in rows] == ["pages", "arena", "store", "off"]
    bench_transfer._report(rows, as_json=True)
    out = json.loads(capsys.readouterr().out)
    assert out["by_path"]["pages"]["max_stall_over_one_layer"] == pytest.approx(0.4)
    assert out["by_path"]["arena"]["max_stall_over_one_layer"] == pytest.approx(0.6)
    assert out["by_path"]["store"]["max_stall_over_one_layer"] == pytest.approx(2.0)
    assert out["max_stall_over_one_layer"] == pytest.approx(0.4)  # the default path's
    assert out["rows"][0]["path"] == "pages" and out["rows"][0]["page_copies"] == 4
    bench_transfer._report(rows, as_json=False)
    text = capsys.readouterr()
    assert "pages" in text.out and "path store: worst stall = 10.0 ms" in text.err


def test_a_prefill_worker_of_several_ranks_is_measured_without_lent_pages(capsys):
    assert bench_transfer.paths(1) == ["pages", "arena", "store", "off"]
    assert bench_transfer.paths(2) == ["arena", "store", "off"]
    rows = [
        Breakdown(1, True, True, 0.070, 0.065, 0.003, 0.005, 0.005),
        Breakdown(1, True, False, 0.080, 0.065, 0.010, 0.005, 0.015),
    ]
    bench_transfer._report(rows, as_json=True, degrees=(2, 1))
    out = json.loads(capsys.readouterr().out)
    assert (out["prefill_tp"], out["decode_tp"]) == (2, 1)
    assert out["max_stall_over_one_layer"] == pytest.approx(0.6)  # the arena's, with no pages
    assert set(out["by_path"]) == {"arena", "store"}


def test_the_stall_percentiles_are_against_moving_one_layer_alone(capsys):
    def sample(lent, direct, layerwise, stall_s, layer_s):
        return Breakdown(1, layerwise, direct, 0.1, 0.09, stall_s, layer_s, 0.01, lent=lent)

    samples = [sample(True, True, True, stall / 1e3, 0.005) for stall in range(1, 101)]
    samples += [sample(False, False, False, 0.03, layer) for layer in (0.001, 0.002, 0.003)]
    percentiles = bench_transfer.stall_percentiles(samples)
    assert percentiles["layer_move_ms"] == pytest.approx(2.0)  # the median of the off path
    pages = percentiles["by_path"]["pages"]
    assert pages["requests"] == 100 and pages["p50_ms"] == pytest.approx(50.5)
    assert pages["p99_over_layer_move"] == pytest.approx(99.01 / 2.0)
    assert set(percentiles["by_path"]) == {"pages"}  # no samples of the other paths
    assert bench_transfer.stall_percentiles(samples[:5]) == {}  # nothing moved alone
    bench_transfer._report(samples[:1], as_json=False, samples=samples)
    err = capsys.readouterr().err
    assert "path pages: stall p50 = 50.5 ms = 25.25 x moving one layer alone (2.00 ms" in err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_request_by_each_path_on_a_live_cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir) as (cluster, _):
        asyncio.run(bench_transfer.run(cluster, [1], 32, 1, seed=1))  # opens the lent cache
        samples = []
        rows = asyncio.run(bench_transfer.run(cluster, [2], 32, 1, seed=0, all_samples=samples))
    assert [r.path for r in rows] == ["pages", "arena", "store", "off"]
    assert all(r.num_chunks == 2 and 0 < r.transfer_stall_s < r.ttft_s for r in rows)
    layers = cluster.info.num_layers
    assert [r.page_copies for r in rows] == [2 * layers, 0, 0, 0]
    assert samples == rows  # one sample per point: the best is the only one
    assert set(bench_transfer.stall_percentiles(samples)["by_path"]) == {"pages", "arena", "store"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_command_measures_prompts_its_warm_up_did_not_cache(tiny_model_dir, capsys):
    """The whole command, warm-up included: a measured prompt that the warm-up had put in the
    store would be read from there before the prefill published it (KV in before the last
    layer, as the store path once reported). Streaming, the last layer is in only after it
    was published (without streaming, the time is taken once all layers are queued, and a
    tiny model's first ones may land before it)."""
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--chunks", "1"]
    assert bench_transfer.main([*args, "--chunk-tokens", "32", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["path"] for r in rows] == ["pages", "arena", "store", "off"]
    assert all(r["kv_landed_s"] > 0 for r in rows if r["layerwise"]), rows


def test_8_bit_kv_is_compared_path_by_path_in_stall_and_bytes(monkeypatch, capsys):
    """`--kv-cache-dtype K`: the same prompts on a cluster with the model's KV, then with K
    (tests/cluster/test_cluster_kv_8bit.py measures the bytes on a live one)."""
    from halfmoon.bench.probes import transfer_kv

    def sample(path, stall_s, kv_bytes):
        layerwise, direct, lent = bench_transfer.PATHS[path]
        row = Breakdown(2, layerwise, direct, 0.1, 0.09, stall_s, 0.001, 0.01, lent=lent)
        row.kv_bytes = kv_bytes
        return row

    def measured(settings, args, chunk_counts, chunk_tokens):
        quantized = settings["engine.kv_cache_dtype"] != "auto"
        stall, size = (0.002, 34) if quantized else (0.004, 128)
        return [sample(p, stall, 2 * size) for p in bench_transfer.PATHS], "float32"

    monkeypatch.setattr(transfer_kv, "measure_cluster", measured)
    args = argparse.Namespace(kv_cache_dtype="int8")
    figures = transfer_kv.compare_kv_formats({}, args, [2], 32)
    assert figures["model_dtype"] == "float32" and figures["kv_cache_dtype"] == "int8"
    for row in figures["by_path"].values():
        assert row["unit_bytes"] == [128, 34] and row["bytes_ratio"] == pytest.approx(34 / 128)
        assert row["stall_ratio"] == pytest.approx(0.5)
    text = bench_transfer.format_kv_formats(figures)
    assert "pages: stall p50 4.00 vs 2.00 ms (0.50x), KV a unit 128 vs 34 bytes (0.266x)" in text
