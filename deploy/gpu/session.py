"""Runs one step of the GPU session (deploy/gpu/session_plan.py), or named commands of it.

    session.py --step N          step N: the preflight (compiler, Python.h, a Triton smoke
                                 kernel), the arguments of every command checked, then each
                                 command under its time limit; logs, each command's JSON and
                                 summary.json into OUT/step-N (OUT: $OUT, else gpu-session/)
    session.py --only [NAME...]  those commands (none: all; bench-gpu.sh), into OUT
    session.py --plan            the steps, their commands, planned times and goal figures

On a CUDA host it measures; without one it measures nothing and exits 0, unless
GPU_SESSION_CPU=1: a rehearsal of the same steps on CPU with the tiny model, where each
command runs its cheap stand-in or has only its arguments checked, and each step says its
runtime here and its planned runtime on the GPU. Run it through session.sh (which installs
the wheelhouse once and picks the Python).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from preflight import preflight
from session_plan import COMMANDS, SHARED_GPU, STEP_BUDGET_S, STEPS, Command, Step

ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 20  # after SIGINT, before SIGKILL: time to shut a cluster down


class _Parsed(Exception):
    """Raised by the patched parser once a benchmark's arguments parsed: nothing runs."""


def check_arguments(command: Command) -> str | None:
    """Why `command`'s GPU arguments would be refused (its CLI's own parser, or `bash -n` for a
    script), or None; runs nothing."""
    if command.is_script:
        result = subprocess.run(["bash", "-n", command.argv[1]], cwd=ROOT, capture_output=True)
        return result.stderr.decode().strip() or None
    from halfmoon.cluster.cli import BENCHMARKS

    target, args = command.argv[1], list(command.argv[2:])
    if command.argv[0] != "bench" or target not in BENCHMARKS:
        return f"halfmoon {' '.join(command.argv[:2])}: no such benchmark"
    exit_code = _parse_only(importlib.import_module(BENCHMARKS[target]).main, args)
    return None if exit_code is None else f"halfmoon bench {target} refused {args} ({exit_code})"


def _parse_only(main, args: list[str]) -> str | None:
    """Call a benchmark's `main(args)` but stop once its parser accepted them; None, or why not."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, *a, **k):
        original(parser, *a, **k)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(args)
        except _Parsed:
            return None
        except SystemExit as exit_:
            return f"exit {exit_.code}"
    return "it ran without parsing its arguments"


def run_command(command: Command, out: Path, rehearsal: bool, left_s: float) -> dict:
    """Run `command` (or its rehearsal stand-in) under its limit; its record for the summary."""
    record = {"name": command.name, "planned_gpu_s": command.planned_s, "limit_s": command.limit_s}
    if command.shares_gpu:
        record["note"] = SHARED_GPU
    argv = command.cpu_argv if rehearsal else command.argv
    if argv is None:
        return {**record, "mode": "arguments checked", "rc": 0, "seconds": 0.0}
    if left_s < command.limit_s:
        return {**record, "mode": f"skipped: {left_s:.0f} s of the step's budget left", "rc": None}
    env = {**os.environ, **command.env, **(command.cpu_env if rehearsal else {})}
    env["OUT"] = str(out / command.name)  # scripts write their own files there
    env["GPU_PREFLIGHT_DONE"] = "1"  # test-gpu.sh need not run it again
    started = time.perf_counter()
    rc, stdout = _run(_full_argv(argv), out / f"{command.name}.log", env, command.limit_s)
    record.update(mode="ran", rc=rc, seconds=round(time.perf_counter() - started, 1))
    (out / f"{command.name}{'.out' if command.is_script else '.json'}").write_text(stdout)
    record["result"] = _json_or_none(stdout)
    return record


def _full_argv(argv: tuple[str, ...]) -> list[str]:
    if argv[0] == "bash":
        return list(argv)
    return [sys.executable, "-m", "halfmoon.cluster.cli", *argv]


def _run(argv: list[str], log: Path, env: dict, limit_s: int) -> tuple[int, str]:
    """Exit status (124 past the limit, as `timeout` says) and stdout; stderr into `log`."""
    with log.open("w") as err:
        process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, _ = process.communicate(timeout=limit_s)
            return process.returncode, stdout
        except subprocess.TimeoutExpired:
            return 124, _stop(process)


def _stop(process: subprocess.Popen) -> str:
    """Interrupt a command past its limit (a benchmark then stops the cluster it started),
    kill its process group STOP_GRACE_S later; what it printed."""
    for signal_, grace_s in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal_)
        try:
            return process.communicate(timeout=grace_s)[0]
        except subprocess.TimeoutExpired:
            continue
    return ""


def _json_or_none(text: str):
    """`text` as a JSON object, or its last line that is one (a benchmark's --json), or None."""
    for line in [text, *reversed(text.strip().splitlines())]:
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    return None


def run_commands(commands: list[Command], out: Path, rehearsal: bool) -> dict:
    """The preflight, every command's arguments checked, then the commands in order within
    STEP_BUDGET_S; what each did."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    checks = preflight()
    refused = {c.name: why for c in commands if (why := check_arguments(c)) is not None}
    records = []
    for command in commands if checks["ok"] and not refused else []:
        left_s = STEP_BUDGET_S - (time.perf_counter() - started)
        records.append(run_command(command, out, rehearsal, left_s))
        _say(f"   {command.name}: {records[-1]['mode']}, exit {records[-1]['rc']}")
    failed = [r["name"] for r in records if r["rc"] not in (0, None)]
    return {
        "device": "cpu (GPU_SESSION_CPU=1 rehearsal)" if rehearsal else "cuda",
        "preflight": checks,
        "refused_arguments": refused,
        "commands": records,
        "ok": checks["ok"] and not refused and not failed,
        "seconds": round(time.perf_counter() - started, 1),
    }


def run_step(step: Step, out: Path, rehearsal: bool) -> dict:
    """Step `step` into `out`: its summary.json, also returned."""
    _say(f"== step {step.number} ({step.title}): {step.goal}")
    summary = {"step": step.number, "title": step.title, "goal": step.goal}
    summary.update(run_commands(list(step.commands), out, rehearsal))
    summary.update(planned_gpu_s=step.planned_s, budget_s=STEP_BUDGET_S)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    where = "here (CPU rehearsal)" if rehearsal else "on the GPU"
    _say(
        f"step {step.number} ({step.title}): {summary['seconds']:.1f} s {where}; planned on the "
        f"GPU: {step.planned_s} s of its {STEP_BUDGET_S} s; ok: {summary['ok']}; {out}/summary.json"
    )
    return summary


def show_plan() -> None:
    for step in STEPS:
        print(f"step {step.number} ({step.title}, planned {step.planned_s} s): {step.goal}")
        for c in step.commands:
            print(f"  {c.name:14} {c.planned_s:4} s (limit {c.limit_s:3}): {' '.join(c.argv)}")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="session.py", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, choices=[step.number for step in STEPS])
    which.add_argument("--only", nargs="*", choices=sorted(COMMANDS), metavar="NAME")
    which.add_argument("--plan", action="store_true")
    args = parser.parse_args(argv)
    if args.plan:
        show_plan()
        return 0
    rehearsal = os.environ.get("GPU_SESSION_CPU") == "1"
    if not rehearsal and os.environ.get("HALFMOON_GPU") != "1":
        _say("session: no CUDA GPU here (and/or no .whl wheelhouse); nothing to measure")
        return 0
    out = Path(os.environ.get("OUT") or ROOT / "gpu-session")
    if args.only is not None:  # no names: every command
        commands = [COMMANDS[name] for name in args.only or COMMANDS]
        summary = run_commands(commands, out, rehearsal)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    else:
        summary = run_step(STEPS[args.step - 1], out / f"step-{args.step}", rehearsal)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
