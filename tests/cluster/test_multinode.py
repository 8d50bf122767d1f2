"""halfmoon across Ray nodes (tests/cluster/multinode_scenario.py, run in a process of its own:
one Ray per process), first with KV through the stores: prefill and decode on nodes of their
own, KV crossing nodes through the store nodes, outputs equal to the offline engine, a prefix
the Conductor prices as a fetch from another node's store loaded from there (every plan is
executed), and a node lost during traffic. Then on Mooncake's Transfer Engine
(engine_transfer_scenario.py): outputs equal the offline engine's, the bytes the engine moved
are the requests' KV, no layer came as a Ray object; a prefix fetched and a replication from
another node's store are read out of its arena on the engine; a prefill node killed
mid-transfer is a retry that completes."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario_kit import run_scenario

SCENARIO = Path(__file__).with_name("multinode_scenario.py")
GiB = 1 << 30


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    return run_scenario(SCENARIO, tiny_model_dir, tmp_path_factory.mktemp("multinode"), 840)


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def on_nodes(placement: dict, kind: str) -> list[str]:
    return sorted(node for name, node in placement.items() if name.startswith(kind))


def test_pools_land_on_their_nodes_and_the_router_on_the_head(report):
    placement = report["placement"]
    # Each prefill worker on a prefill node of its own.
    assert on_nodes(placement, "prefill") == report["prefill_nodes"]
    assert on_nodes(placement, "decode") == [report["decode_node"]]
    assert report["router_node"] == report["head"]


def test_every_node_has_a_store_sized_from_its_memory(report):
    stores = report["stores"]
    assert set(stores) == {report["head"], *report["prefill_nodes"], report["decode_node"]}
    for node, figures in stores.items():
        assert figures["capacity_bytes"] == int(0.25 * report["memory"][node]) == GiB // 2


def test_kv_crosses_nodes_through_the_stores_and_outputs_equal_the_offline_engine(report):
    assert report["outputs"] == report["expected"]
    stores = report["stores"]
    # The prefill nodes' stores hold the published blocks; the decode node pulled them across.
    assert sum(stores[node]["blocks"] for node in report["prefill_nodes"]) > 0
    assert stores[report["decode_node"]]["blocks"] == 0
    assert report["kv_transfer_bytes"] > 0


def test_a_prefix_on_another_node_is_fetched_from_its_store_and_outputs_match(report):
    fetch = report["fetch"]
    first, second = fetch["first"], fetch["second"]
    assert fetch["outputs"] == report["expected_fetch"]
    assert second["prefill_instance"] != first["prefill_instance"]
    holder_store = fetch["stores"][first["prefill_instance"]]
    assert "fetch " in fetch["explain"] and holder_store in fetch["explain"]
    assert second["loaded_from"] == holder_store
    assert second["num_loaded_tokens"] >= 16 * 20  # most of the prefix's blocks
    assert second["num_cached_tokens"] >= second["num_loaded_tokens"]


def test_a_worker_without_room_waits_without_blocking_the_controller(report):
    assert report["started_without_room"] == "decode-3"
    assert report["pending_without_room"] == ["decode-3"]
    assert report["registered_on_spare"] is True
    assert report["placement_after"]["decode-3"] == report["spare_node"]


def test_losing_the_decode_node_moves_its_streams_to_the_spare_and_nothing_hangs(report):
    assert report["hung"] == []
    # Each stream cut by the node's loss migrates to the spare's decode worker and goes on.
    assert report["during_outcomes"] == report["expected_during"]
    assert report["dead_removed"] is True
    assert report["decode_node"] not in report["stores_after"]
    assert report["outputs_while_pending"] == report["expected"]  # the spare's worker serves


def test_the_controller_replaces_the_lost_worker_once_a_node_has_room(report):
    # One replacement waits for room (a first try may land on the dying node before Ray
    # notices and be started again under the next name).
    (waiting,) = report["pending_after_removal"]
    assert waiting.startswith("decode-")
    assert report["replaced"] is True
    assert report["num_restarts"] == 1
    after = report["placement_after"]
    assert sorted([after.pop("prefill-0"), after.pop("prefill-1")]) == report["prefill_nodes"]
    assert after.pop("decode-3") == report["spare_node"]
    assert list(after.values()) == [report["second_spare_node"]]
    assert report["outputs_after"] == report["expected"]


@pytest.fixture(scope="module")
def engine(report) -> dict:
    """The second cluster's report, on the transfer engine."""
    if "unavailable" in report["engine"]:
        pytest.skip(report["engine"]["unavailable"])
    return {**report["engine"], "expected_fetch": report["expected_fetch"]}


def test_outputs_on_the_engine_equal_the_offline_engine(engine):
    assert engine["outputs"] == engine["expected"][:3]


def test_the_engine_moved_exactly_the_requests_kv_and_no_ray_object_carried_any(engine):
    prefills, decode = engine["prefill"], engine["decode"]
    assert {p["kv_transfer_path"] for p in prefills} == {"mooncake tcp"}
    assert decode["kv_transfer_path"] == "mooncake tcp"
    assert set(engine["status"].values()) == {"mooncake tcp"}  # as `halfmoon status` shows

    def grew(key: str) -> int:
        before = sum(p[key] for p in engine["prefill_before"])
        return sum(p[key] for p in prefills) - before

    kv_bytes = sum(engine["num_blocks"][:3]) * engine["block_bytes"]
    assert grew("engine_bytes_written") == kv_bytes
    assert grew("num_failed_engine_writes") == 0
    assert decode["num_engine_receives"] - engine["decode_before"]["num_engine_receives"] == 3
    assert decode["num_streamed_layers"] == 0  # start-up's requests included
    assert decode["num_refused_landed_notices"] == 0
    # Each first token went on the engine too (the decode worker joins on it or on the
    # router's hand-off, whichever comes first: tests/cluster/test_decode_engine_receive.py).
    assert grew("num_engine_token_notices") == 3


def test_a_prefix_fetched_from_another_nodes_store_is_read_on_the_engine(engine):
    fetch = engine["fetch"]
    assert fetch["outputs"] == engine["expected_fetch"]
    assert fetch["second"]["loaded_from"] == fetch["holder_store"]
    loader = fetch["counters"][0]  # the fetching worker's, before the replication
    assert loader["num_object_loads"] == 0
    blocks = fetch["second"]["num_loaded_tokens"] // 16
    assert blocks >= 20  # most of the prefix's blocks
    assert loader["num_engine_prefix_layers"] > 0
    assert loader["engine_bytes_read"] == blocks * engine["block_bytes"]


def test_a_replication_from_another_nodes_store_is_read_on_the_engine(engine):
    before, after = engine["fetch"]["counters"]
    assert engine["fetch"]["warmed"] >= 1
    assert after["num_object_loads"] == before["num_object_loads"]
    read = after["engine_bytes_read"] - before["engine_bytes_read"]
    assert read == engine["fetch"]["warmed"] * engine["block_bytes"]


def test_a_prefill_node_killed_mid_transfer_is_retried_and_completes(engine):
    assert engine["killed"] is not None  # a prefill worker was writing its layers
    # The router retries the cut request on the other prefill worker, at once.
    assert engine["outcome_after_kill"] == engine["expected"][3]
    # At once: not after the decode worker's wait for missing layers (store.get_timeout_s, 10 s).
    assert engine["retried_in_s"] < 10.0
    assert engine["output_again"] == engine["expected"][3]
    # The cut receive's slots wait out their quarantine; the rest came back.
    after = engine["decode_after"]
    assert after["num_staging_grants"] >= 5
    assert after["num_engine_receives"] >= 4
