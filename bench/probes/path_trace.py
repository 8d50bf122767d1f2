"""Which project files run code for one streaming chat completion on a live 1 + 1 cluster, in
the order they are first entered, with the thread and process each ran on.

`halfmoon serve` (disaggregated, one node, the router's short-prompt bypass off) runs with
`path_trace_site/sitecustomize.py` in every process: a profile hook noting each epoch's first
call into each project file (not .venv/, tests/, bench/). After a warm-up, epoch 1 holds one
streaming request (max_tokens=8) and the 1 s after it, epoch 3 an idle window as long: what
runs anyway. The issue's figures: the request window's files (the model's step and kernels as
one, "the model") and folder changes (adjacent entries of that list in different folders).

    python -m halfmoon.bench.probes.path_trace [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = Path(__file__).resolve().parent / "path_trace_site"
THE_MODEL = "the model"
# The forward pass: the model, its runner, the layers and tensors it builds, and the kernels.
MODEL_PREFIXES = ("kernels/",)
MODEL_STEP = (
    ("model", "model_runner", "rope", "cpu_linear", "cpu_memory"),
    ("step_inputs", "device_copy", "cuda_graphs", "cuda_events", "tensor_parallel"),
)
MODEL_FILES = frozenset(f"engine/{name}.py" for names in MODEL_STEP for name in names)
EPOCH_REQUEST, EPOCH_SETTLE, EPOCH_IDLE, EPOCH_END = 1, 2, 3, 4
SETTLE_BEFORE_S, TRAIL_S, SETTLE_AFTER_S = 0.3, 1.0, 0.5
# Different words: the measured prompt finds no warm-up prefix beyond the chat template's.
WARM_UP_TEXT, MEASURED_TEXT = "Warm up, please.", "Say hello."
MAX_TOKENS = 8
# Ray's GCS and raylet and the actors' pollers, idle, use a few % of a core together.
QUIET_CPU_S, QUIET_SPAN_S, QUIET_TIMEOUT_S = 0.15, 1.0, 90.0


def folder_of(path: str) -> str:
    """The folder of a repo-relative file (`cluster/serving`, `engine`; `.` at the root)."""
    return str(Path(path).parent) if path != THE_MODEL else THE_MODEL


def collapse_model(path: str) -> str:
    """`the model` for a file of the model's step or a kernel; any other path as it is."""
    return THE_MODEL if path in MODEL_FILES or path.startswith(MODEL_PREFIXES) else path


def count_folder_changes(paths: list[str]) -> int:
    """How many adjacent entries of `paths` lie in different folders."""
    folders = [folder_of(path) for path in paths]
    return sum(1 for left, right in zip(folders, folders[1:], strict=False) if left != right)


def process_role(title: str) -> str:
    """A short name for a process from its title: `RouterActor` for `ray::RouterActor.start`."""
    if title.startswith("ray::"):
        return title[len("ray::") :].split(" ")[0].split(".")[0]
    words = title.split()
    if "serve" in words and any(word.endswith("halfmoon") for word in words):
        return "halfmoon serve"
    return " ".join(Path(word).name for word in words[:3])


def first_entries(records: list[dict], origin_s: float, collapse: bool = True) -> list[dict]:
    """The first record of each file (collapsed: of each entry) in time order, `at_ms` after
    `origin_s`, with the other processes it also ran in."""
    entries: dict[str, dict] = {}
    for record in sorted(records, key=lambda r: (r["t"], r["pid"], r["file"])):
        name = collapse_model(record["file"]) if collapse else record["file"]
        if name not in entries:
            entries[name] = _entry(name, record, origin_s)
        role, entry = process_role(record["title"]), entries[name]
        if role != entry["process"] and role not in entry["also_in"]:
            entry["also_in"].append(role)
    return list(entries.values())


def _entry(name: str, record: dict, origin_s: float) -> dict:
    return {
        "file": name,
        "thread": record["thread"],
        "process": process_role(record["title"]),
        "title": record["title"],
        "function": record["fn"],
        "at_ms": round((record["t"] - origin_s) * 1000, 1),
        "first_file": record["file"] if name == THE_MODEL else None,
        "also_in": [],
    }


def window_figures(records: list[dict], origin_s: float) -> dict:
    """One window's figures: entries (model collapsed), file counts, folder changes."""
    entries = first_entries(records, origin_s)
    raw = [entry["file"] for entry in first_entries(records, origin_s, collapse=False)]
    return {
        "files": len(entries),
        "files_uncollapsed": len(raw),
        "folder_changes": count_folder_changes([entry["file"] for entry in entries]),
        "folder_changes_uncollapsed": count_folder_changes(raw),
        "entries": entries,
    }


def load_records(trace_dir: Path, epoch: int) -> list[dict]:
    """Every process's records of one epoch."""
    records = []
    for path in sorted(trace_dir.glob(f"*-{epoch}.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


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


def wait_for_api(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The API's base URL once serve prints it (after its calibration requests) and
    `GET /v1/models` answers; fails with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"halfmoon serve exited ({process.returncode}):\n{_tail(log)}")
        found = re.search(r"OpenAI\s+(http://\S+/v1)", _tail(log))
        if found and _answers(f"{found[1]}/models"):
            return found[1]
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


def stream_chat(client, model: str, text: str) -> int:
    """One streaming chat completion of `text` read to its end; the number of chunks."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},  # the random tiny model may draw EOS early
    )
    return sum(1 for _ in stream)


def set_epoch(trace_dir: Path, epoch: int) -> float:
    """Start epoch `epoch` in every traced process (their pollers read it); when, wall time."""
    tmp = trace_dir / "epoch.tmp"
    tmp.write_text(f"{epoch}\n")
    tmp.replace(trace_dir / "epoch")
    return time.time()


def wait_for_dumps(trace_dir: Path, epoch: int, timeout_s: float = 10.0) -> None:
    """Until every process that wrote the request window has written `epoch` too."""
    pids = {path.name.split("-")[0] for path in trace_dir.glob(f"*-{EPOCH_REQUEST}.jsonl")}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pids <= {path.name.split("-")[0] for path in trace_dir.glob(f"*-{epoch}.jsonl")}:
            return
        time.sleep(0.1)


def measure(client, trace_dir: Path, serve_pid: int) -> dict:
    """The warm-up, then the measured request's window and the idle one (wall times)."""
    model = client.models.list().data[0].id
    stream_chat(client, model, WARM_UP_TEXT)
    quiet = wait_until_quiet(serve_pid)
    request_at = set_epoch(trace_dir, EPOCH_REQUEST)
    time.sleep(SETTLE_BEFORE_S)
    sent_at = time.time()
    chunks = stream_chat(client, model, MEASURED_TEXT)
    time.sleep(TRAIL_S)
    request_s = set_epoch(trace_dir, EPOCH_SETTLE) - request_at
    time.sleep(SETTLE_AFTER_S)
    idle_at = set_epoch(trace_dir, EPOCH_IDLE)
    time.sleep(request_s)
    idle_s = set_epoch(trace_dir, EPOCH_END) - idle_at
    wait_for_dumps(trace_dir, EPOCH_IDLE)
    run = {"model": model, "chunks": chunks, "quiet_before": quiet, "sent_at": sent_at}
    return {**run, "idle_at": idle_at, "request_window_s": request_s, "idle_window_s": idle_s}


def run_cluster(trace_dir: Path, model: str | None, timeout_s: float, bypass: bool) -> dict:
    """Serve, measure, stop: the run's facts and both windows' records."""
    import openai

    log = trace_dir / "serve.log"
    set_epoch(trace_dir, 0)
    config = None if bypass else trace_dir / "no-bypass.yaml"
    if config is not None:  # the router then never prefills on the decode worker
        config.write_text("router:\n  bypass_threshold_tokens: 0\n")
    with open(log, "w") as out:
        command, env = serve_command(model, config), serve_env(trace_dir)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    started: list[int] = []
    api_key = os.environ.get("HALFMOON_API_KEY") or "unused"  # serve's own default key
    try:
        base_url = wait_for_api(process, log, timeout_s)
        started = descendants(process.pid)
        with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            facts = measure(client.with_options(timeout=timeout_s), trace_dir, process.pid)
    finally:
        stop_serve(process, sorted({*started, *descendants(process.pid)}))
    facts["request"] = load_records(trace_dir, EPOCH_REQUEST)
    facts["idle"] = load_records(trace_dir, EPOCH_IDLE)
    return facts


def summarize(facts: dict) -> dict:
    """The report: both windows' figures and the entries only the request window has."""
    request = window_figures(facts["request"], facts["sent_at"])
    idle = window_figures(facts["idle"], facts["idle_at"])
    idle_files = {entry["file"] for entry in idle["entries"]}
    only = [entry["file"] for entry in request["entries"] if entry["file"] not in idle_files]
    records = facts["request"] + facts["idle"]
    keys = ("model", "chunks", "quiet_before", "request_window_s", "idle_window_s")
    model_files = {r["file"] for r in records if collapse_model(r["file"]) != r["file"]}
    return {
        "run": {key: facts[key] for key in keys},
        "request": request,
        "idle": idle,
        "request_only": only,
        "processes": sorted({process_role(r["title"]) for r in records}),
        "model_files": sorted(model_files),
    }


def render(report: dict) -> str:
    """The human-readable summary: the ordered list, then the figures."""
    request, idle, run = report["request"], report["idle"], report["run"]
    lines = [
        f"Request window: one streaming chat completion ({run['model']}, {run['chunks']} chunks),",
        "1 prefill + 1 decode; ms: after the request was sent",
        f"{'#':>3} {'ms':>7}  {'file':<40} {'thread':<24} process",
        *_entry_lines(request),
        f"\n{THE_MODEL!r}: {', '.join(report['model_files']) or '(none)'}",
    ]
    lines += _figure_lines("request window", request, run["request_window_s"])
    lines += _figure_lines("idle window", idle, run["idle_window_s"])
    lines += [f"  request window only: {len(report['request_only'])} files"]
    lines += ["\nIdle window (what runs anyway), ms: after it began", *_entry_lines(idle)]
    return "\n".join(lines)


def _entry_lines(figures: dict) -> list[str]:
    return [_entry_line(number, entry) for number, entry in enumerate(figures["entries"], 1)]


def _entry_line(number: int, entry: dict) -> str:
    also = f"  (also {', '.join(entry['also_in'])})" if entry["also_in"] else ""
    head = f"{number:>3} {entry['at_ms']:>7.1f}  {entry['file']:<40} {entry['thread']:<24}"
    return f"{head} {entry['process']}{also}"


def _figure_lines(name: str, figures: dict, length_s: float) -> list[str]:
    changes, changes_raw = figures["folder_changes"], figures["folder_changes_uncollapsed"]
    return [
        f"\n{name} ({length_s:.2f} s):",
        f"  files: {figures['files']} ({THE_MODEL} as one), {figures['files_uncollapsed']} apart",
        f"  folder changes: {changes} ({changes_raw} along the list with the model apart)",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="halfmoon bench path-trace",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("--json", metavar="FILE", help="write the full result here")
    parser.add_argument("--model", help="passed to `halfmoon serve --model` (default: its own)")
    parser.add_argument(
        "--timeout-s", type=float, default=240.0, help="for the server to answer, and per request"
    )
    bypass = "let the router prefill a short prompt on the decode worker (off: prefill, hand-off"
    parser.add_argument("--bypass", action="store_true", help=f"{bypass}, decode)")
    parser.add_argument("--keep-trace", action="store_true", help="keep the raw trace folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace_dir = Path(tempfile.mkdtemp(prefix="halfmoon-path-trace-"))
    try:
        report = summarize(run_cluster(trace_dir, args.model, args.timeout_s, args.bypass))
    except BaseException:
        print(f"path trace failed; its trace and serve.log: {trace_dir}", file=sys.stderr)
        raise
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.keep_trace:
        print(f"\nraw trace: {trace_dir}")
    else:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
