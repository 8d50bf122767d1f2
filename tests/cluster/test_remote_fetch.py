"""Every plan is executed: a prefix the Conductor prices as a fetch from another node's store
is loaded from there (tests/cluster/fetch_scenario.py, in a process of its own: one Ray per
process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario_kit import run_scenario

SCENARIO = Path(__file__).with_name("fetch_scenario.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory) -> dict:
    return run_scenario(SCENARIO, tiny_model_dir, tmp_path_factory.mktemp("fetch"), 540)


def test_the_prefill_workers_are_on_nodes_of_their_own(report):
    nodes = report["nodes"]
    prefill_nodes = sorted(node for name, node in nodes.items() if name.startswith("prefill"))
    assert prefill_nodes == report["prefill_nodes"]


def test_a_prefix_on_another_node_is_fetched_from_its_store_and_outputs_match(report):
    first, second = report["first"], report["second"]
    assert report["outputs"] == report["expected"]
    assert second["prefill_instance"] != first["prefill_instance"]
    holder_store = report["stores"][first["prefill_instance"]]
    assert "fetch " in report["explain"] and holder_store in report["explain"]
    assert second["loaded_from"] == holder_store
    assert second["num_loaded_tokens"] >= 16 * 20  # most of the prefix's blocks
    assert second["num_cached_tokens"] >= second["num_loaded_tokens"]
