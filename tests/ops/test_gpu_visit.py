"""The next GPU visit as one command, `bash deploy/gpu/visit.sh answer` (issue 51): planned
within one device call of 480 s, it serves colocated and disaggregated 1P+1D on the one GPU
(TTFT, TPOT, goodput, the largest rate meeting the SLOs), splits served TTFT, then runs the tests
that never ran on a GPU and the regression benchmarks. Its CPU rehearsal (VISIT_CPU=1, the tiny
model) runs here, so the command cannot rot before a GPU host is lent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "gpu"))
import serve_report  # noqa: E402 - deploy/gpu is not a package

DEVICE_CALL_S = 480  # what the answer may take of the device's 15 minutes (docs/gpu.md)
MAX_FILES = 8  # the device tool returns at most this many files from $OUT
PLAN = re.compile(r"^plan: (\d+) s on the GPU = (.*) \(deadline (\d+) s\)$", re.M)


def _visit(tmp_path: Path, *parts: str, timeout: int, **env: str):
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "VISIT_LOGS": str(tmp_path / "logs")}
    return subprocess.run(
        ["bash", "deploy/gpu/visit.sh", *parts],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run(attainment: float | None) -> dict:
    return {"slo_attainment": attainment}


def test_the_rate_search_bisects_between_the_largest_met_and_the_smallest_missed_rate():
    assert serve_report.next_rate({2.0: _run(1.0), 8.0: _run(0.95)}, 0.9) == 16.0
    assert serve_report.next_rate({2.0: _run(1.0), 8.0: _run(0.5)}, 0.9) == 4.0
    assert serve_report.next_rate({2.0: _run(0.2), 8.0: None}, 0.9) == 1.0  # None: killed
    assert serve_report.next_rate({8.0: _run(1.0), 11.0: _run(0.1)}, 0.9) is None  # close enough
    assert serve_report.next_rate({}, 0.9) is None


def test_the_summary_names_the_largest_rate_each_mode_met(tmp_path):
    figures = dict(
        median_ttft_ms=40.0,
        p99_ttft_ms=90.0,
        median_tpot_ms=9.5,
        p99_tpot_ms=12.0,
        request_goodput=1.9,
        output_throughput=250.0,
        failed=0,
    )
    for mode, rate, attainment in [("colocated", 2, 1.0), ("colocated", 8, 0.5)]:
        run = {**figures, "slo_attainment": attainment}
        (tmp_path / f"serve-{mode}-{rate}rps.json").write_text(json.dumps(run))
    lines = serve_report.summary(tmp_path, 0.9, "1", "true", ["ttft:2000", "tpot:100"])
    assert lines[0] == serve_report.SHARED_GPU
    assert "colocated    2 req/s: TTFT p50 40 / p99 90 ms, TPOT p50 9.5 / p99 12.0 ms" in lines[2]
    assert lines[-2:] == [
        "disaggregated: nothing ran",
        "    colocated: largest rate meeting the SLOs 2 req/s (missed at 8)",
    ]


def test_the_answer_is_planned_within_one_device_call_and_says_when_there_is_no_gpu(tmp_path):
    run = _visit(tmp_path, "answer", timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    planned, plan, deadline = PLAN.search(summary).groups()
    caps = [int(n) for n in re.findall(r"(\d+)", plan)]
    assert int(planned) == sum(caps) <= DEVICE_CALL_S and int(deadline) < DEVICE_CALL_S
    assert plan.split(" + ")[2:] == [
        f"{part} {cap}"
        for part, cap in zip(
            ["answer-serve", "answer-ttft", "features", "step", "engine"], caps[2:], strict=True
        )
    ]
    assert "every figure stays unmeasured" in summary


@pytest.mark.slow  # three clusters start (two `halfmoon serve`, one `bench ttft`): ~2 minutes
@pytest.mark.timeout(660)
def test_a_cpu_rehearsal_of_the_answer_gives_every_section_in_at_most_8_files(tmp_path, capsys):
    started = time.perf_counter()
    run = _visit(tmp_path, "answer", timeout=640, VISIT_CPU="1")
    seconds = time.perf_counter() - started
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    assert run.returncode == 0, summary + run.stdout[-3000:]
    for section in (
        "in the disaggregated run its two processes time-slice it",
        "disaggregated    2 req/s: TTFT p50",
        "disaggregated    8 req/s: TTFT p50",
        "colocated    2 req/s: TTFT p50",
        "colocated    8 req/s: TTFT p50",
        "TPOT p50",
        "goodput",
        "split p50: queue",
        "features: rc=0",
        "features| 1 passed",
        "step: rc=0",
        "step| batch 1: wall",
        "engine: rc=0",
        "x transformers static",
    ):
        assert section in summary, f"{section!r} missing from\n{summary}"
    for mode in ("disaggregated", "colocated"):  # a loaded machine may meet them at no rate
        assert re.search(rf"{mode}: (largest rate meeting the SLOs|met the SLOs at none)", summary)
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt", "visit.tgz"]
    assert len(list(out.iterdir())) <= MAX_FILES
    with tarfile.open(out / "visit.tgz") as bundle:
        names = set(bundle.getnames())
    assert {"./answer-ttft.log", "./features.xml", "./serve/summary.txt"} <= names
    planned = int(PLAN.search(summary).group(1))
    assert planned <= DEVICE_CALL_S
    with capsys.disabled():
        print(
            f"\ngpu visit `answer`: {seconds:.0f} s on CPU (rehearsal); planned on the GPU: "
            f"{planned} s of one {DEVICE_CALL_S} s device call"
        )
