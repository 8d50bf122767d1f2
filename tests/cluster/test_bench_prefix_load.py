"""`halfmoon bench prefix-load`: its report, its argument checks, and a short live run of both
paths (a stored prefix copied out of the store's arena vs read as Ray objects)."""

from __future__ import annotations

import json

import pytest
import ray
from cluster_kit import running_cluster

from halfmoon.bench.probes import prefix_load as bench_prefix_load

pytestmark = pytest.mark.usefixtures("ray_session")


def test_the_report_gives_each_length_both_paths_and_their_ratio(capsys):
    rows = [
        {
            "prefix_tokens": 512,
            "median_ms": {"arena": 80.0, "objects": 100.0},
            "samples_ms": {"arena": [80.0], "objects": [100.0]},
            "objects_over_arena": 1.25,
        }
    ]
    bench_prefix_load._report(rows, as_json=True)
    assert json.loads(capsys.readouterr().out)["rows"] == rows
    bench_prefix_load._report(rows, as_json=False)
    assert "    512      80.0      100.0          1.25" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--tokens", "100"], ["--tokens", "a,b"], ["--repeats", "0"]])
def test_bad_arguments_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_prefix_load.main([*args, "--device", "cpu"])
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stored_prefix_is_loaded_by_each_path_on_a_live_cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir, **{"prefill.replicas": 2}) as (cluster, _):
        row = bench_prefix_load.measure(cluster, 64, 1, seed=0)
        loader = [n for n, w in cluster.workers.items() if w.kind == "prefill"][1]
        counters = ray.get(cluster.workers[loader].actor.counters.remote())
    assert row["prefix_tokens"] == 64 and set(row["median_ms"]) == {"arena", "objects"}
    assert all(ms > 0 for ms in row["median_ms"].values())
    # only the arena path's load copied out of the arena: one copy per layer
    assert counters["num_arena_loads"] == cluster.info.num_layers
