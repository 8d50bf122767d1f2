"""The server `halfmoon bench path-trace` measures: `halfmoon serve` started with the tracer in
every process (`path_trace_site/`), waited for until it answers and is quiet, and stopped with
every process it started."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = Path(__file__).resolve().parent / "path_trace_site"
# Ray's GCS and raylet and the actors' pollers, idle, use a few % of a core together.
QUIET_CPU_S, QUIET_SPAN_S, QUIET_TIMEOUT_S = 0.15, 1.0, 90.0


def serve_command(model: str | None, config: Path | None) -> list[str]:
    """`halfmoon serve` as a user runs it: 1 prefill + 1 decode on ports it picks free."""
    script = Path(sys.executable).parent / "halfmoon"
    start = [str(script)] if script.exists() else [sys.executable, "-m", "halfmoon.cluster.cli"]
    ports = ["--port", "0", "--metrics-port", "0", "--http-port", "0"]
    shape = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]
    options = ["--model", model] if model else []
    options += ["--config", str(config)] if config else []
    return start + ["serve", *ports, *shape, *options]


def serve_env(trace_dir: Path) -> dict[str, str]:
    """This environment, with the tracer first on PYTHONPATH and a Ray of the server's own."""
    path = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": "local"}
    env["HALFMOON_PATH_TRACE_DIR"], env["HALFMOON_PATH_TRACE_ROOT"] = str(trace_dir), str(REPO_ROOT)
    env.setdefault("RAY_gcs_server_port_wait_time_s", "120")  # a busy 2-core machine is slow
    return env


def wait_for_api(process: subprocess.Popen, log: Path, timeout_s: float) -> tuple[str, str]:
    """The OpenAI API's base URL and the gRPC address once serve prints them (after its
    calibration requests) and `GET /v1/models` answers; fails with the server's log if it
    exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"halfmoon serve exited ({process.returncode}):\n{_tail(log)}")
        found = re.search(r"OpenAI\s+(http://\S+/v1)", _tail(log))
        grpc_at = re.search(r"gRPC\s+(\S+:\d+)", _tail(log))
        if found and grpc_at and _answers(f"{found[1]}/models"):
            return found[1], grpc_at[1]
        time.sleep(1.0)
    raise RuntimeError(f"halfmoon serve did not answer in {timeout_s:g} s:\n{_tail(log)}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (none once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def cpu_s(pids: list[int]) -> float:
    """The CPU time (user + system) the processes `pids` have used so far."""
    ticks = sum(int(f[11]) + int(f[12]) for f in map(_stat, pids) if len(f) > 12)
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(parent: int, timeout_s: float = QUIET_TIMEOUT_S) -> bool:
    """Until the server's processes use under `QUIET_CPU_S` in a `QUIET_SPAN_S` (start-up work
    such as the grammar builder's imports is over); False if never within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = descendants(parent) + [parent]
        before_s = cpu_s(pids)
        time.sleep(QUIET_SPAN_S)
        if cpu_s(pids) - before_s < QUIET_CPU_S:
            return True
    return False


def _tail(log: Path, num_chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-num_chars:] if log.exists() else ""


def descendants(parent: int) -> list[int]:
    """Every process `parent` started, and theirs (Ray's GCS, raylet, workers, Redis)."""
    found, todo = [], [parent]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True)
        children = [int(pid) for pid in out.stdout.split()]
        found, todo = found + children, todo + children
    return found


def stop_serve(process: subprocess.Popen, started: list[int], timeout_s: float = 120) -> None:
    """SIGINT and a clean exit; past `timeout_s` a kill, then any of its processes left."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(map(_alive, started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in filter(_alive, started):  # only this server's own: other Rays may be running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    return _stat(pid)[:1] not in ([], ["Z"])
