"""A prefix the Conductor prices as a fetch from another node's store, read out of that store's
arena on Mooncake's Transfer Engine (tests/cluster/fetch_scenario.py with `engine`, in a
process of its own): outputs equal the offline engine's, the bytes read are the prefix's KV,
and no layer of it came as a Ray object; the same for a replication (`warm`) from there."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario_kit import run_scenario

SCENARIO = Path(__file__).with_name("fetch_scenario.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    out = tmp_path_factory.mktemp("fetch-engine")
    return run_scenario(SCENARIO, tiny_model_dir, out, 540, "engine")


def test_the_prefix_is_read_from_the_other_nodes_arena_on_the_engine(report):
    first, second = report["first"], report["second"]
    assert report["outputs"] == report["expected"]
    assert second["loaded_from"] == report["stores"][first["prefill_instance"]]
    loader = report["warm_counters"][0]  # the second worker's, before the replication
    assert loader["kv_transfer_path"] == "mooncake tcp"
    assert loader["num_object_loads"] == 0
    blocks = second["num_loaded_tokens"] // 16
    assert blocks >= 20  # most of the prefix's blocks
    assert loader["num_engine_prefix_layers"] > 0
    assert loader["engine_bytes_read"] == blocks * report["block_bytes"]


def test_a_replication_from_the_other_nodes_store_is_read_on_the_engine(report):
    before, after = report["warm_counters"]
    assert report["warmed"] >= 1
    assert after["num_object_loads"] == before["num_object_loads"]
    read = after["engine_bytes_read"] - before["engine_bytes_read"]
    assert read == report["warmed"] * report["block_bytes"]
