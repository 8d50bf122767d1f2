"""`halfmoon bench engine --tp T`: our engine at T ranks against one, on the same requests."""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time

import pytest
import torch

from halfmoon.bench import engine as bench_engine
from halfmoon.bench.probes import engine_turns
from halfmoon.bench.probes.engine_degrees import compare_degrees
from halfmoon.bench.probes.engine_dtypes import compare_dtypes


@pytest.fixture(autouse=True)
def brief_quiet(monkeypatch):
    """A timed turn waits at most 0.5 s for the CPUs to go idle: under `make test` the other
    test process keeps them busy, and the 10 s wait of every turn bought nothing (what the
    wait does is tested below, with its own timeout)."""
    brief = functools.partial(engine_turns.after_quiet, timeout_s=0.5)
    monkeypatch.setattr(engine_turns, "after_quiet", brief)


@pytest.mark.timeout(120)
def test_tp_times_each_degree_on_the_same_requests(tiny_model_dir, capsys):
    work = bench_engine.make_workload(3, 200, seed=0, scale=0.1)
    args = argparse.Namespace(tp=2, batch_size=4, device="cpu", repeats=1)
    figures = compare_degrees(tiny_model_dir, work, torch.float32, args)
    assert figures["tp"] == 2
    assert figures["ratio_tp_vs_tp1"] == pytest.approx(figures["tp_tok_s"] / figures["tp1_tok_s"])
    assert "ours at T=1" in capsys.readouterr().err


def test_tp_needs_two_ranks_or_more_and_no_peer():
    for argv in (["--tp", "1"], ["--tp", "2", "--peer", "vllm"]):
        with pytest.raises(SystemExit):
            bench_engine.main(argv)


@pytest.mark.timeout(120)
def test_several_thread_counts_run_in_turns_and_print_the_scaling(tiny_model_dir, capsys):
    work = bench_engine.make_workload(3, 200, seed=0, scale=0.1)
    args = argparse.Namespace(thread_counts=[1, 2], peer=None, batch_size=4, repeats=2)
    threads_before = torch.get_num_threads()
    try:
        figures = engine_turns.compare_in_turns(tiny_model_dir, work, torch.float32, args)
    finally:
        torch.set_num_threads(threads_before)
    scalings = figures["ours_scalings"]  # a turn's 1-thread seconds over its 2-thread seconds
    assert len(scalings) == 2 and figures["ours_scaling"] == pytest.approx(
        sum(scalings) / 2, abs=1e-3
    )
    assert figures["ours_tok_s_1t"] > 0 and figures["ours_tok_s_2t"] > 0
    assert "vllm_scaling" not in figures
    err = capsys.readouterr().err
    assert "turn 1, 2 thread(s): ours" in err and "turn 0, 1 thread(s): ours" in err


@pytest.mark.timeout(120)
def test_vs_dtype_times_both_dtypes_in_turns_and_prints_the_ratio(tiny_model_dir, capsys):
    work = bench_engine.make_workload(3, 200, seed=0, scale=0.1)
    args = argparse.Namespace(
        vs_dtype="float32",
        vs_kv_cache_dtype=None,
        kv_cache_dtype="auto",
        batch_size=4,
        device="cpu",
        repeats=2,
    )
    figures = compare_dtypes(tiny_model_dir, work, torch.bfloat16, args)
    assert len(figures["ratios_vs_float32"]) == 2
    assert figures["ours_tok_s"] > 0 and figures["float32_tok_s"] > 0
    assert "turn 1: ours" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_vs_kv_cache_dtype_times_8_bit_kv_against_the_models_dtype(tiny_model_dir, capsys):
    work = bench_engine.make_workload(3, 200, seed=0, scale=0.1)
    args = argparse.Namespace(
        vs_dtype=None,
        vs_kv_cache_dtype="auto",
        kv_cache_dtype="int8",
        batch_size=4,
        device="cpu",
        repeats=1,
    )
    figures = compare_dtypes(tiny_model_dir, work, torch.float32, args)
    assert figures["ours_tok_s"] > 0 and figures["kv_auto_tok_s"] > 0
    assert len(figures["ratios_vs_kv_auto"]) == 1
    assert "turn 0: ours" in capsys.readouterr().err


def test_vs_dtype_takes_one_thread_count_and_no_peer_or_tp():
    for extra in (["--peer", "vllm"], ["--tp", "2"], ["--threads", "1", "2"]):
        with pytest.raises(SystemExit):
            bench_engine.main(["--vs-dtype", "float32", *extra])
    for extra in (["--vs-dtype", "float32"], ["--tp", "2"], ["--threads", "1", "2"]):
        with pytest.raises(SystemExit):
            bench_engine.main(["--vs-kv-cache-dtype", "auto", *extra])


def test_thread_counts_are_distinct_and_several_only_on_cpu_without_tp_and_repeats_one_or_more():
    bad = (["--threads", "1", "1"], ["--threads", "0"], ["--threads", "1", "2", "--tp", "2"])
    for argv in (*bad, ["--threads", "1", "2", "--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_engine.main(argv)


@pytest.mark.timeout(60)
def test_a_timed_run_waits_for_the_cpus_to_go_idle():
    spinner = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass"
    busy = subprocess.Popen([sys.executable, "-c", spinner])
    try:
        started = time.monotonic()
        ran_at = engine_turns.after_quiet(time.monotonic, timeout_s=20)
        assert ran_at - started >= 0.5  # not while the spinner held a core
    finally:
        busy.wait()
    assert 0.0 <= engine_turns._busy_fraction(0.05) <= 1.0


@pytest.mark.timeout(120)
def test_a_given_model_is_timed_in_place_of_the_generated_one(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--requests", "1", "--scale", "0.02", "--skip-hf-cb"]
    assert bench_engine.main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    figures = json.loads(out)
    assert figures["requests"] == 1 and figures["ours_tok_s"] > 0
    assert f"model {tiny_model_dir} " in err
