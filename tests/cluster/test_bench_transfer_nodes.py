"""`halfmoon bench transfer --across-nodes` (bench/probes/transfer_nodes.py): a small run in a
process of its own (a pytest process holds one Ray instance only, and the bench makes Ray nodes
of its own) reports the three paths, each with its bytes/s, and the ratios against issue 48's
goals, and, NIXL's directory missing, that the `nixl` path was skipped and why; and the
helpers its figures rest on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scenario_kit import SCENARIO_ENV

from halfmoon.bench.probes import transfer_nodes

PATHS = {"ray", "engine", "tcp"}
SMALL = ["--unit-mib", "4", "--layers", "4", "--repeats", "2", "--pieces", "1,4"]


def test_a_unit_splits_into_near_equal_pieces_laid_out_in_turn():
    assert transfer_nodes.split(10, 3) == [4, 3, 3]
    assert transfer_nodes.offsets([4, 3, 3]) == [0, 4, 7]
    assert transfer_nodes.split(8, 1) == [8] and transfer_nodes.offsets([8]) == [0]


def test_each_ratio_is_judged_against_its_goal():
    assert transfer_nodes.judged("engine_over_tcp", 0.6)["met"]
    assert not transfer_nodes.judged("engine_over_ray", 2.4)["met"]
    stall = transfer_nodes.judged("engine_stall_over_layer", 1.6)
    assert stall == {"value": 1.6, "goal": "<= 1.5", "met": False}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_small_run_reports_every_path_and_the_ratios(tmp_path):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine cannot be imported")
    out, no_nixl = tmp_path / "nodes.json", tmp_path / "no-nixl"  # NIXL is never installed
    command = [sys.executable, "-m", "halfmoon.cluster.cli", "bench", "transfer", "--across-nodes"]
    result = subprocess.run(
        [*command, *SMALL, "--in-flight", "1,2", "--nixl", str(no_nixl), "--json", str(out)],
        env={**os.environ, **SCENARIO_ENV},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    summary = json.loads(out.read_text())
    assert json.loads(result.stdout.strip().splitlines()[-1]) == summary  # the JSON line
    assert (summary["unit_bytes"], summary["layer_bytes"], summary["layers"]) == (
        4 << 20,
        1 << 20,
        4,
    )
    assert set(summary["paths"]) == PATHS
    for row in summary["paths"].values():
        assert row["bytes_per_s"] > 0 and row["layer_move_ms"] > 0 and row["stall_ms"] > 0
    knobs = {(row["pieces"], row["in_flight"]) for row in summary["engine_variants"]}
    assert knobs == {(1, 1), (1, 2), (4, 1), (4, 2)}
    best = max(row["bytes_per_s"] for row in summary["engine_variants"])
    assert summary["paths"]["engine"]["bytes_per_s"] == best
    ratios = summary["ratios"]
    assert set(ratios) == {"engine_over_tcp", "engine_over_ray", "engine_stall_over_layer"}
    tcp = summary["paths"]["tcp"]["bytes_per_s"]
    assert ratios["engine_over_tcp"]["value"] == pytest.approx(best / tcp)
    assert all(r["value"] > 0 and isinstance(r["met"], bool) for r in ratios.values())
    assert "engine_over_ray = " in result.stdout and "(goal >= 2.5" in result.stdout
    assert summary["nixl"] == {
        "measured": False,
        "skipped": f"--nixl {no_nixl}: no such directory (`make nixl-peer` builds .peers-nixl)",
    }
    assert f"nixl: skipped (--nixl {no_nixl}: no such directory" in result.stdout


def test_nixl_is_skipped_with_its_reason_when_its_directory_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .peers-nixl here
    assert transfer_nodes.nixl.nixl_dir(None) == (
        None,
        "no .peers-nixl/ here (`make nixl-peer` builds it)",
    )
    assert transfer_nodes.nixl.nixl_dir(str(tmp_path / "gone"))[0] is None
    (tmp_path / ".peers-nixl").mkdir()
    assert transfer_nodes.nixl.nixl_dir(None) == (str(tmp_path / ".peers-nixl"), "")
    lines = transfer_nodes.nixl.nixl_lines({"measured": False, "skipped": "why"})
    assert lines == ["nixl: skipped (why)"]
