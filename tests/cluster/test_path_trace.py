"""The path trace (`python -m halfmoon.bench.probes.path_trace`): its counting functions, its
per-process tracer in a plain subprocess, and one end-to-end run of each API on one live 1 + 1
cluster, held against docs/architecture.md's walks of the two requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from halfmoon.bench.probes import path_trace, path_trace_serve, path_walks
from halfmoon.bench.probes.path_trace import first_entries, process_role, window_figures
from halfmoon.bench.probes.path_walks import (
    THE_MODEL,
    collapse_model,
    count_folder_changes,
    folder_of,
)


def _record(at_s: float, file: str, title: str = "ray::RouterActor", pid: int = 1) -> dict:
    return {"t": at_s, "pid": pid, "title": title, "thread": "MainThread", "file": file, "fn": "f"}


def test_the_folder_of_a_file_is_its_directory_from_the_repo_root():
    assert folder_of("cluster/serving/request.py") == "cluster/serving"
    assert folder_of("engine/llm_engine.py") == "engine"
    assert folder_of("kvstore/transfer/plan.py") == "kvstore/transfer"
    assert folder_of("__init__.py") == "."
    assert folder_of(THE_MODEL) == THE_MODEL


def test_the_model_step_and_kernels_collapse_into_one_entry():
    for path in ("kernels/cpu_gemm.py", "kernels/__init__.py", "engine/model.py"):
        assert collapse_model(path) == THE_MODEL
    assert collapse_model("engine/model_runner.py") == THE_MODEL
    for path in ("engine/llm_engine.py", "engine/sampler.py", "engine/model_config.py"):
        assert collapse_model(path) == path


def test_folder_changes_count_adjacent_entries_in_different_folders():
    assert count_folder_changes([]) == 0
    assert count_folder_changes(["engine/a.py"]) == 0
    assert count_folder_changes(["engine/a.py", "engine/b.py", "router/c.py"]) == 1
    assert count_folder_changes(["engine/a.py", "router/c.py", "engine/b.py"]) == 2
    assert count_folder_changes(["cluster/a.py", "cluster/serving/b.py"]) == 1


def test_a_process_is_named_by_its_ray_actor_class_or_its_command():
    assert process_role("ray::PrefillWorker.prefill") == "PrefillWorker"
    assert process_role("ray::RouterActor") == "RouterActor"
    assert process_role("/w/.venv/bin/python3 /w/.venv/bin/halfmoon serve --port 1") == (
        "halfmoon serve"
    )


def test_first_entries_keep_time_order_and_count_the_model_once():
    records = [
        _record(3.0, "engine/model.py", "ray::DecodeWorker", pid=2),
        _record(1.0, "cluster/frontend/http_server.py"),
        _record(2.0, "kernels/ops.py", "ray::PrefillWorker", pid=3),
        _record(4.0, "cluster/frontend/http_server.py", "ray::DecodeWorker", pid=2),
    ]
    entries = first_entries(records, origin_s=1.0)
    assert [e["file"] for e in entries] == ["cluster/frontend/http_server.py", THE_MODEL]
    assert entries[1]["first_file"] == "kernels/ops.py" and entries[1]["at_ms"] == 1000.0
    assert entries[0]["also_in"] == ["DecodeWorker"] and entries[1]["also_in"] == ["DecodeWorker"]
    figures = window_figures(records, origin_s=0.0)
    assert (figures["files"], figures["files_uncollapsed"]) == (2, 3)
    assert (figures["folder_changes"], figures["folder_changes_uncollapsed"]) == (1, 2)


def test_the_tracer_writes_each_epoch_of_a_process_when_the_epoch_changes(tmp_path):
    """A plain interpreter with the site folder first: project files only, first entries."""
    (tmp_path / "epoch").write_text("0\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(path_trace_serve.SITE_DIR),
        "HALFMOON_PATH_TRACE_DIR": str(tmp_path),
        "HALFMOON_PATH_TRACE_ROOT": str(path_trace_serve.REPO_ROOT),
    }
    script = f"""
import pathlib, time
epoch = pathlib.Path({str(tmp_path / "epoch")!r})
epoch.write_text("1"); time.sleep(0.3)
from halfmoon.router import conductor
from halfmoon.bench.probes import path_walks
path_walks.folder_of("engine/a.py")
epoch.write_text("2"); time.sleep(0.3)
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert done.returncode == 0
    (written,) = tmp_path.glob("*-1.jsonl")
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    files = [row["file"] for row in rows]
    assert "router/conductor.py" in files and len(files) == len(set(files))
    assert not any(file.startswith(("bench/", "tests/", ".venv/")) for file in files)
    pid = int(written.name.split("-")[0])
    assert all(row["thread"] == "MainThread" and row["pid"] == pid for row in rows)
    assert rows == sorted(rows, key=lambda row: row["t"])
    before = (tmp_path / f"{pid}-0.jsonl").read_text()
    assert "router/conductor.py" not in before


def test_a_walk_misses_request_only_files_and_lists_no_stale_ones():
    walks = {
        "openai": [
            {"files": ["cluster/frontend/http_server.py"], "when": False},
            {"files": ["engine/model.py", "kernels/ops.py"], "when": False},
            {"files": ["router/conductor.py"], "when": True},
            {"files": ["engine/gone_away.py"], "when": False},
        ],
        "background": ["cluster/serving/router_actor.py"],
    }
    entries = ["cluster/frontend/http_server.py", THE_MODEL, "engine/llm_engine.py"]
    report = {
        "api": "openai",
        "request": {"entries": [{"file": file} for file in entries]},
        "request_only": [*entries, "cluster/serving/router_actor.py"],
    }
    assert path_walks.walk_gaps(report, walks) == {
        "missing": ["engine/llm_engine.py"],
        "gone": ["engine/gone_away.py"],
        "not_run": ["engine/gone_away.py"],
    }


# Files every walk must show: if one drops out, the trace lost the request, not the doc.
CORE_FILES = (
    "router/conductor.py",
    "prefill_worker/worker.py",
    "decode_worker/worker.py",
    "engine/llm_engine.py",
    THE_MODEL,
)
SERVERS = {"openai": "cluster/frontend/http_server.py", "grpc": "cluster/frontend/grpc_server.py"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_request_of_each_api_on_one_live_cluster_matches_the_docs_walks(tmp_path, capsys):
    """One server, an OpenAI streaming chat and then a gRPC `Generate` in epochs of their own;
    each API's request-only files must all be in its walk in docs/architecture.md, and the
    walk lists no file that is gone or did not run (unless the doc marks it "when ...")."""
    out = tmp_path / "path.json"
    assert path_trace.main(["--api", "both", "--json", str(out)]) == 0
    reports = json.loads(out.read_text())
    walks = path_walks.doc_walks(path_walks.DOC.read_text())
    assert set(reports) == set(path_trace.APIS)
    for api, report in reports.items():
        request = report["request"]
        assert report["api"] == report["run"]["api"] == api and report["run"]["chunks"] > 1
        files = {entry["file"] for entry in request["entries"]}
        expected = {SERVERS[api], *CORE_FILES}
        assert expected <= files, (api, sorted(expected - files))
        assert all(isinstance(e["thread"], str) and e["thread"] for e in request["entries"])
        assert {"PrefillWorker", "DecodeWorker", "RouterActor"} <= set(report["processes"])
        for window in (request, report["idle"]):
            assert isinstance(window["folder_changes"], int) and window["folder_changes"] >= 0
        assert report["idle"]["files"] < request["files"] <= request["files_uncollapsed"]
        idle_files = {entry["file"] for entry in report["idle"]["entries"]}
        assert SERVERS["openai"] not in idle_files  # no poll runs the HTTP API
        if api == "grpc":  # the gRPC request did not go through HTTP
            assert SERVERS["openai"] not in files
        gaps = path_walks.walk_gaps(report, walks)
        assert gaps == {"missing": [], "gone": [], "not_run": []}, (
            f"docs/architecture.md {path_walks.WALK_HEADINGS[api]!r} and the trace disagree "
            f"(re-measure: halfmoon bench path-trace --api both): {gaps}"
        )
    printed = capsys.readouterr().out
    assert "folder changes" in printed and "gRPC Generate" in printed
