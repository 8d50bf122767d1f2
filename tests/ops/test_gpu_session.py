"""The GPU session planned as code (deploy/gpu/session_plan.py, session.py, `make gpu-session`):
every step fits a device call, the wheelhouse installs once, the serving benchmark prefills in
chunks its prompts suit, and a CPU rehearsal of all four steps (GPU_SESSION_CPU=1, the tiny
model) runs here so the scripts cannot rot. It prints each step's runtime here and planned on
the GPU; the GPU figures themselves are measured only on a GPU."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "gpu"))
import session  # noqa: E402 - deploy/gpu is not a package
import session_plan  # noqa: E402
import wheelhouse  # noqa: E402

from halfmoon.cluster.config import load_config  # noqa: E402

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_every_step_fits_one_device_call_by_plan_and_by_limits():
    for step in session_plan.STEPS:
        assert step.planned_s <= session_plan.STEP_BUDGET_S, step.title
        assert all(c.planned_s < c.limit_s <= session_plan.STEP_BUDGET_S for c in step.commands)
    assert [step.number for step in session_plan.STEPS] == [1, 2, 3, 4]


def test_a_command_past_the_steps_budget_is_skipped_not_started(tmp_path):
    command = session_plan.COMMANDS["transfer"]
    record = session.run_command(command, tmp_path, rehearsal=False, left_s=command.limit_s - 1)
    assert record["rc"] is None and record["mode"].startswith("skipped")
    assert record["note"] == session_plan.SHARED_GPU  # prefill and decode share the GPU


def test_arguments_a_benchmark_no_longer_takes_are_caught_before_anything_runs():
    renamed = session_plan.Command("step", ("bench", "step", "--batches", "64"), 1, 2)
    assert "refused" in session.check_arguments(renamed)
    assert session.check_arguments(session_plan.COMMANDS["step"]) is None


def test_the_wheelhouse_installs_once_per_wheelhouse(tmp_path, monkeypatch):
    manifest = {"python_version": HERE, "arch": platform.machine(), "wheels": [], "debs": []}
    (tmp_path / "wheelhouse.json").write_text(json.dumps(manifest))
    installs = []
    monkeypatch.setattr(wheelhouse, "install_files", lambda *args: installs.append(args))
    prefix = tmp_path / "prefix"
    argv = ["install", "--wheelhouse", str(tmp_path), "--prefix", str(prefix), "--print-env"]
    assert wheelhouse.main(argv) == 0 and wheelhouse.main(argv) == 0
    assert len(installs) == 1  # the second found the stamp
    (tmp_path / "wheelhouse.json").write_text(json.dumps({**manifest, "built": "later"}))
    assert wheelhouse.main(argv) == 0 and len(installs) == 2  # another wheelhouse: again


def test_the_serving_benchmark_prefills_its_prompts_in_one_or_two_chunks():
    engine = yaml.safe_load((ROOT / "deploy" / "gpu" / "serve-engine.yaml").read_text())
    config = load_config(None, {"model": "unused", **{f"engine.{k}": v for k, v in engine.items()}})
    chunk = config.engine.prefill_chunk_size
    # bench serve / live-capacity: 512-2048 tokens (serve-bench.sh); the default chunk is 64.
    settings = (chunk, config.engine.dtype, config.engine.max_num_batched_tokens)
    assert settings == (1024, "bfloat16", 4096)
    assert -(-2048 // chunk) == 2 and -(-512 // chunk) == 1
    script = (ROOT / "deploy" / "gpu" / "serve-bench.sh").read_text()
    assert "deploy/gpu/serve-engine.yaml" in script


@pytest.mark.timeout(300)
def test_a_cpu_rehearsal_of_the_four_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPU_SESSION_CPU", "1")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = []
    for step in session_plan.STEPS:
        started = time.perf_counter()
        assert session.main(["--step", str(step.number)]) == 0, _failure(tmp_path, step.number)
        rows.append((step, time.perf_counter() - started))
    summaries = [json.loads((tmp_path / f"step-{n}/summary.json").read_text()) for n in range(1, 5)]
    assert [s["ok"] and s["preflight"]["smoke"]["ok"] for s in summaries] == [True] * 4
    assert summaries[0]["commands"][0]["mode"] == "ran"  # the suite's script really ran
    with capsys.disabled():
        for step, seconds in rows:
            print(
                f"\ngpu-session step {step.number} ({step.title}): {seconds:.1f} s on CPU "
                f"(rehearsal); planned on the GPU: {step.planned_s} s of "
                f"{session_plan.STEP_BUDGET_S} s"
            )


def _failure(out: Path, number: int) -> str:
    """What the step's summary and logs say, for the assertion message."""
    step = out / f"step-{number}"
    texts = [p.read_text()[-1500:] for p in sorted(step.glob("*")) if p.is_file()]
    return "\n".join(texts) or f"nothing in {step}"


def test_session_sh_says_there_is_nothing_to_measure_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "GPU_SESSION_CPU"}
    result = subprocess.run(
        ["bash", "deploy/gpu/session.sh", "--step", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "nothing to measure" in result.stderr


def test_the_preflight_kernel_is_compiled_from_a_file_triton_can_read(monkeypatch):
    # Compiled (not interpreted), `@triton.jit` reads the kernel's source with `inspect`: from
    # `python -c` it refuses ("should be defined in a Python file"), which failed the first GPU
    # run's preflight. Here the launch then fails for want of a GPU, but not for that.
    import preflight

    monkeypatch.setattr(preflight, "_has_cuda", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = preflight.smoke_kernel()
    assert "defined in a Python file" not in result.get("error", "")


@pytest.mark.timeout(120)
def test_a_short_visit_bundles_its_logs_into_one_file_the_device_returns(tmp_path):
    # The device tool returns at most 8 files: deploy/gpu/visit.sh puts every log in one tarball
    # after each part, and says how each part ended in summary.txt (here on CPU: no GPU to use).
    env = {**os.environ, "OUT": str(tmp_path / "out"), "VISIT_LOGS": str(tmp_path / "logs")}
    env["VISIT_BUDGET_S"] = "90"
    run = subprocess.run(
        ["bash", "deploy/gpu/visit.sh", "kernels", "failed", "bogus"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "preflight: rc=0" in summary and "kernels: rc=0" in summary
    assert "bogus: no such part" in summary and "visit:" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.txt", "visit.tgz"]
    with tarfile.open(tmp_path / "out" / "visit.tgz") as bundle:
        assert {"./preflight.log", "./kernels.log", "./summary.txt"} <= set(bundle.getnames())


def test_gpu_tests_that_take_gpu_memory_share_one_xdist_group(tmp_path):
    """Several engines or clusters at once on one GPU asked for ~190 GB of 143 (issue 51): the
    `gpu` tests outside tests/kernels share one group, which the visit's `--dist loadgroup`
    runs on one worker, one at a time."""
    plugin = tmp_path / "groups_probe.py"
    plugin.write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        if 'gpu' in item.keywords:\n"
        "            groups = [m.args for m in item.iter_markers('xdist_group')]\n"
        "            print('GROUP', item.path.parent.name, groups)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "groups_probe",
            "-p",
            "no:cacheprovider",
            "tests/engine/test_warmup.py",
            "tests/cluster/test_gpu_cluster.py",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    lines = [line for line in probe.stdout.splitlines() if line.startswith("GROUP")]
    assert lines, probe.stdout[-2000:] + probe.stderr[-2000:]
    assert all(line.endswith("[('gpu-memory',)]") for line in lines), lines
    assert "--dist loadgroup" in (ROOT / "deploy/gpu/visit.sh").read_text()
