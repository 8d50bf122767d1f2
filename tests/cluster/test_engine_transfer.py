"""KV across Ray nodes on Mooncake's Transfer Engine (engine_transfer_scenario.py, in a process of
its own): outputs equal the offline engine's, the bytes the engine moved are the requests' KV,
no layer came as a Ray object; a prefix fetched and a replication from another node's store are
read out of its arena on the engine; a prefill node killed mid-transfer is a retry that
completes."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario_kit import run_scenario

SCENARIO = Path(__file__).with_name("engine_transfer_scenario.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    return run_scenario(SCENARIO, tiny_model_dir, tmp_path_factory.mktemp("engine"), 840)


def test_outputs_equal_the_offline_engine(report):
    assert report["outputs"] == report["expected"][:3]


def test_the_engine_moved_exactly_the_requests_kv_and_no_ray_object_carried_any(report):
    prefills, decode = report["prefill"], report["decode"]
    assert {p["kv_transfer_path"] for p in prefills} == {"mooncake tcp"}
    assert decode["kv_transfer_path"] == "mooncake tcp"
    assert set(report["status"].values()) == {"mooncake tcp"}  # as `halfmoon status` shows

    def grew(key: str) -> int:
        before = sum(p[key] for p in report["prefill_before"])
        return sum(p[key] for p in prefills) - before

    kv_bytes = sum(report["num_blocks"][:3]) * report["block_bytes"]
    assert grew("engine_bytes_written") == kv_bytes
    assert grew("num_failed_engine_writes") == 0
    assert decode["num_engine_receives"] - report["decode_before"]["num_engine_receives"] == 3
    assert decode["num_streamed_layers"] == 0  # start-up's requests included
    assert decode["num_refused_landed_notices"] == 0
    # Each first token went on the engine too (the decode worker joins on it or on the
    # router's hand-off, whichever comes first: tests/cluster/test_decode_engine_receive.py).
    assert grew("num_engine_token_notices") == 3


def test_a_prefix_fetched_from_another_nodes_store_is_read_on_the_engine(report):
    fetch = report["fetch"]
    assert fetch["outputs"] == report["expected_fetch"]
    assert fetch["second"]["loaded_from"] == fetch["holder_store"]
    loader = fetch["counters"][0]  # the fetching worker's, before the replication
    assert loader["num_object_loads"] == 0
    blocks = fetch["second"]["num_loaded_tokens"] // 16
    assert blocks >= 20  # most of the prefix's blocks
    assert loader["num_engine_prefix_layers"] > 0
    assert loader["engine_bytes_read"] == blocks * report["block_bytes"]


def test_a_replication_from_another_nodes_store_is_read_on_the_engine(report):
    before, after = report["fetch"]["counters"]
    assert report["fetch"]["warmed"] >= 1
    assert after["num_object_loads"] == before["num_object_loads"]
    read = after["engine_bytes_read"] - before["engine_bytes_read"]
    assert read == report["fetch"]["warmed"] * report["block_bytes"]


def test_a_prefill_node_killed_mid_transfer_is_retried_and_completes(report):
    assert report["killed"] is not None  # a prefill worker was writing its layers
    # The router retries the cut request on the other prefill worker, at once.
    assert report["outcome_after_kill"] == report["expected"][3]
    # At once: not after the decode worker's wait for missing layers (store.get_timeout_s, 10 s).
    assert report["retried_in_s"] < 10.0
    assert report["output_again"] == report["expected"][3]
    # The cut receive's slots wait out their quarantine; the rest came back.
    after = report["decode_after"]
    assert after["num_staging_grants"] >= 5
    assert after["num_engine_receives"] >= 4
