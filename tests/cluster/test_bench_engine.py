"""`halfmoon bench engine --tp T`: our engine at T ranks against one, on the same requests."""

from __future__ import annotations

import argparse

import pytest
import torch

from halfmoon.cluster.bench import engine as bench_engine
from halfmoon.cluster.bench.engine_degrees import compare_degrees


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
