"""Which project files run code for one streaming request on a live 1 + 1 cluster (an OpenAI
chat completion over HTTP, or a gRPC `Generate`), in the order they are first entered, with
the thread and process each ran on.

`halfmoon serve` (disaggregated, one node, the router's short-prompt bypass off) runs with
`path_trace_site/sitecustomize.py` in every process: a profile hook noting each epoch's first
call into each project file (not .venv/, tests/, bench/). Per API, after a warm-up through the
same API, one epoch holds one streaming request (max_tokens=8) and the 1 s after it, a later
one an idle window as long: what runs anyway. `--api both` measures both on one server, one
after the other, and writes {"openai": report, "grpc": report}; one API writes its report.
The issue's figures: the request window's files (the model's step and kernels as one, "the
model") and folder changes (adjacent entries of that list in different folders). Last, where
docs/architecture.md's walk of each request and its trace disagree (`walk_gaps`).

    python -m halfmoon.bench.probes.path_trace [--api openai|grpc|both] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from halfmoon.bench.probes.path_trace_serve import (
    descendants,
    serve_command,
    serve_env,
    stop_serve,
    wait_for_api,
    wait_until_quiet,
)
from halfmoon.bench.probes.path_walks import (
    DOC,
    THE_MODEL,
    WALK_SECTION,
    collapse_model,
    count_folder_changes,
    doc_walks,
    walk_report_lines,
)

# Each API's epochs, after the 4 * (its place in the run) of those before it; 0: start-up.
EPOCH_REQUEST, EPOCH_SETTLE, EPOCH_IDLE, EPOCH_END = 1, 2, 3, 4
APIS = ("openai", "grpc")
SETTLE_BEFORE_S, TRAIL_S, SETTLE_AFTER_S = 0.3, 1.0, 0.5
# Different words: the measured prompt finds no warm-up prefix beyond the chat template's.
WARM_UP_TEXT, MEASURED_TEXT = "Warm up, please.", "Say hello."
MAX_TOKENS = 8


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


def stream_generate(client, text: str, timeout_s: float) -> int:
    """One streaming gRPC `Generate` of `text` (as `halfmoon generate` sends it) read to its
    end with the project's own client; the number of deltas."""
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with client.generate(text, timeout=timeout_s, **sampling) as stream:
        return sum(1 for _ in stream)


def set_epoch(trace_dir: Path, epoch: int) -> float:
    """Start epoch `epoch` in every traced process (their pollers read it); when, wall time."""
    tmp = trace_dir / "epoch.tmp"
    tmp.write_text(f"{epoch}\n")
    tmp.replace(trace_dir / "epoch")
    return time.time()


def wait_for_dumps(trace_dir: Path, first: int, epoch: int, timeout_s: float = 10.0) -> None:
    """Until every process that wrote epoch `first` (a request window) has written `epoch`."""
    pids = {path.name.split("-")[0] for path in trace_dir.glob(f"*-{first}.jsonl")}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pids <= {path.name.split("-")[0] for path in trace_dir.glob(f"*-{epoch}.jsonl")}:
            return
        time.sleep(0.1)


def measure(send, trace_dir: Path, serve_pid: int, base: int = 0) -> dict:
    """The warm-up, then the measured request's window and the idle one (wall times), in
    epochs `base` + 1..4; `send(text)` streams one request and returns its chunks."""
    send(WARM_UP_TEXT)
    quiet = wait_until_quiet(serve_pid)
    request_at = set_epoch(trace_dir, base + EPOCH_REQUEST)
    time.sleep(SETTLE_BEFORE_S)
    sent_at = time.time()
    chunks = send(MEASURED_TEXT)
    time.sleep(TRAIL_S)
    request_s = set_epoch(trace_dir, base + EPOCH_SETTLE) - request_at
    time.sleep(SETTLE_AFTER_S)
    idle_at = set_epoch(trace_dir, base + EPOCH_IDLE)
    time.sleep(request_s)
    idle_s = set_epoch(trace_dir, base + EPOCH_END) - idle_at
    wait_for_dumps(trace_dir, base + EPOCH_REQUEST, base + EPOCH_IDLE)
    run = {"chunks": chunks, "quiet_before": quiet, "sent_at": sent_at, "base_epoch": base}
    return {**run, "idle_at": idle_at, "request_window_s": request_s, "idle_window_s": idle_s}


def measure_apis(apis, base_url: str, grpc_at: str, trace_dir: Path, pid: int, timeout_s: float):
    """Each API's facts (`measure`), one after the other on the one server."""
    import openai

    from halfmoon.cluster.client.grpc_client import Client
    from halfmoon.cluster.frontend.auth import API_KEY_ENV

    api_key = os.environ.get(API_KEY_ENV)
    http_key = api_key or "unused"  # the openai client needs one; serve's default asks none
    with (
        openai.OpenAI(base_url=base_url, api_key=http_key, max_retries=0) as http,
        Client(grpc_at, api_key=api_key) as rpc,
    ):
        http = http.with_options(timeout=timeout_s)
        model = http.models.list().data[0].id
        senders = {
            "openai": lambda text: stream_chat(http, model, text),
            "grpc": lambda text: stream_generate(rpc, text, timeout_s),
        }
        runs = []
        for index, api in enumerate(apis):
            facts = measure(senders[api], trace_dir, pid, base=index * EPOCH_END)
            runs.append({"api": api, "model": model, **facts})
        return runs


def run_cluster(
    trace_dir: Path, model: str | None, timeout_s: float, bypass: bool, apis=("openai",)
) -> list[dict]:
    """Serve, measure each API, stop: each run's facts and both its windows' records."""
    log = trace_dir / "serve.log"
    set_epoch(trace_dir, 0)
    config = None if bypass else trace_dir / "no-bypass.yaml"
    if config is not None:  # the router then never prefills on the decode worker
        config.write_text("router:\n  bypass_threshold_tokens: 0\n")
    with open(log, "w") as out:
        command, env = serve_command(model, config), serve_env(trace_dir)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    started: list[int] = []
    try:
        base_url, grpc_at = wait_for_api(process, log, timeout_s)
        started = descendants(process.pid)
        runs = measure_apis(apis, base_url, grpc_at, trace_dir, process.pid, timeout_s)
    finally:
        stop_serve(process, sorted({*started, *descendants(process.pid)}))
    for facts in runs:
        facts["request"] = load_records(trace_dir, facts["base_epoch"] + EPOCH_REQUEST)
        facts["idle"] = load_records(trace_dir, facts["base_epoch"] + EPOCH_IDLE)
    return runs


def summarize(facts: dict) -> dict:
    """The report: both windows' figures and the entries only the request window has."""
    request = window_figures(facts["request"], facts["sent_at"])
    idle = window_figures(facts["idle"], facts["idle_at"])
    idle_files = {entry["file"] for entry in idle["entries"]}
    only = [entry["file"] for entry in request["entries"] if entry["file"] not in idle_files]
    records = facts["request"] + facts["idle"]
    keys = ("api", "model", "chunks", "quiet_before", "request_window_s", "idle_window_s")
    model_files = {r["file"] for r in records if collapse_model(r["file"]) != r["file"]}
    return {
        "api": facts["api"],
        "run": {key: facts[key] for key in keys},
        "request": request,
        "idle": idle,
        "request_only": only,
        "processes": sorted({process_role(r["title"]) for r in records}),
        "model_files": sorted(model_files),
    }


API_REQUESTS = {"openai": "streaming chat completion (HTTP)", "grpc": "streaming gRPC Generate"}


def render(report: dict) -> str:
    """The human-readable summary: the ordered list, then the figures."""
    request, idle, run = report["request"], report["idle"], report["run"]
    what = API_REQUESTS[report["api"]]
    lines = [
        f"Request window: one {what} ({run['model']}, {run['chunks']} chunks),",
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
    parser.add_argument(
        "--api",
        choices=(*APIS, "both"),
        default="openai",
        help="the measured request: an OpenAI streaming chat completion (default), a streaming "
        "gRPC Generate with the project's client, or both on one server ({api: report})",
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
    apis = APIS if args.api == "both" else (args.api,)
    trace_dir = Path(tempfile.mkdtemp(prefix="halfmoon-path-trace-"))
    try:
        runs = run_cluster(trace_dir, args.model, args.timeout_s, args.bypass, apis)
        reports = {facts["api"]: summarize(facts) for facts in runs}
    except BaseException:
        print(f"path trace failed; its trace and serve.log: {trace_dir}", file=sys.stderr)
        raise
    print("\n\n".join(render(report) for report in reports.values()))
    if DOC.is_file() and WALK_SECTION in DOC.read_text():
        print("\n" + "\n".join(walk_report_lines(reports, doc_walks(DOC.read_text()))))
    if args.json:
        result = reports if len(reports) > 1 else reports[apis[0]]
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.keep_trace:
        print(f"\nraw trace: {trace_dir}")
    else:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
