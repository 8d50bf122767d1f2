"""halfmoon across Ray nodes: prefill and decode on nodes of their own, KV crossing nodes
through the store nodes, outputs equal to the offline engine, and a node lost during traffic
(tests/cluster/multinode_scenario.py, run in a process of its own: one Ray per process)."""

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


def test_pools_land_on_their_nodes_and_the_router_on_the_head(report):
    kinds = {name.split("-")[0]: node for name, node in report["placement"].items()}
    assert kinds == {"prefill": report["prefill_node"], "decode": report["decode_node"]}
    assert report["router_node"] == report["head"]


def test_every_node_has_a_store_sized_from_its_memory(report):
    stores = report["stores"]
    assert set(stores) == {report["head"], report["prefill_node"], report["decode_node"]}
    for node, figures in stores.items():
        assert figures["capacity_bytes"] == int(0.25 * report["memory"][node]) == GiB // 2


def test_kv_crosses_nodes_through_the_stores_and_outputs_equal_the_offline_engine(report):
    assert report["outputs"] == report["expected"]
    stores = report["stores"]
    # The prefill node's store holds the published blocks; the decode node pulled them across.
    assert stores[report["prefill_node"]]["blocks"] > 0
    assert stores[report["decode_node"]]["blocks"] == 0
    assert report["kv_transfer_bytes"] > 0


def test_a_worker_without_room_waits_without_blocking_the_controller(report):
    assert report["started_without_room"] == "decode-2"
    assert report["pending_without_room"] == ["decode-2"]
    assert report["registered_on_spare"] is True
    assert report["placement_after"]["decode-2"] == report["spare_node"]


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
    assert after.pop("prefill-0") == report["prefill_node"]
    assert after.pop("decode-2") == report["spare_node"]
    assert list(after.values()) == [report["second_spare_node"]]
    assert report["outputs_after"] == report["expected"]
