"""`halfmoon bench cpu-linear`: the engine's bf16 GEMMs against oneDNN's alone, side by side."""

from __future__ import annotations

import json

import pytest
import torch

from halfmoon.bench.probes import cpu_linear as bench
from halfmoon.kernels import cpu_gemm


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_setting_times_both_paths_and_prints_the_ratio(capsys, dtype):
    threads = torch.get_num_threads()
    argv = ["--rows", "1", "17", "--threads", "1", "--layers", "1", "--repeats", "1", "--json"]
    assert bench.main([*argv, "--dtype", dtype]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["dtype"] == dtype
    assert report["tiled"] == cpu_gemm.available(getattr(torch, dtype))
    assert [(r["threads"], r["rows"]) for r in report["results"]] == [(1, 1), (1, 17)]
    for r in report["results"]:
        assert r["ratio"] == pytest.approx(r["before_ms"] / r["ours_ms"])
    assert torch.get_num_threads() == threads  # put back


def test_counts_below_one_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--rows", "0"])
