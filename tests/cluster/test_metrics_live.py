"""docs/metrics.md and a live cluster's /metrics agree: every documented name and label is
exposed, nothing undocumented is, on the router and on every worker's and store node's own
endpoint, which the router lists in the Prometheus file_sd file it writes."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from cluster_kit import counters, running_cluster
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.usefixtures("ray_session")

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
ACTOR_SECTION = "Per-actor endpoints"
ROW = re.compile(r"^\| `([a-z0-9_:]+)` \| (counter|gauge|histogram|summary) \|([^|]*)\|", re.M)
# Labels the exposition format adds to histogram buckets and summary quantiles.
SAMPLE_LABELS = {"le", "quantile"}
EXPOSED_SUFFIX = {"counter": "_total"}


def documented() -> dict[str, dict[str, set[str]]]:
    """{section kind ("router" or "actor"): {exposed name: label names}} from the doc's tables."""
    tables: dict[str, dict[str, set[str]]] = {"router": {}, "actor": {}}
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        kind = "actor" if section.startswith(ACTOR_SECTION) else "router"
        for name, _type, labels in ROW.findall(section):
            # Label names are the backticked words outside parentheses (which list values).
            tables[kind][name] = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels)))
    return tables


def scrape(address: str) -> dict[str, set[frozenset[str]]]:
    """{exposed family name: the label-name sets of its samples} at http://address/metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + EXPOSED_SUFFIX.get(family.type, "")
        families[name] = {frozenset(s.labels) - SAMPLE_LABELS for s in family.samples}
    return families


def wait_for(condition, timeout_s: float = 60.0):
    """Poll `condition` until it returns something truthy (the router polls every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)
    return value


def undocumented_or_mislabelled(families, table) -> list[tuple[str, object]]:
    problems = []
    for name, label_sets in sorted(families.items()):
        if name not in table:
            problems.append((name, "undocumented"))
            continue
        problems.extend((name, set(labels)) for labels in label_sets if labels != table[name])
    return problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_and_actor_endpoints_expose_exactly_what_the_doc_lists(tiny_model_dir, tmp_path):
    targets_file = tmp_path / "targets" / "halfmoon.json"
    settings = {
        "server.metrics_targets_file": str(targets_file),
        "slo.ttft_s": 100.0,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        for prompt in ("metrics for everyone " * 4, "metrics for everyone " * 4 + "again"):
            client.complete(prompt, max_tokens=4, temperature=0.0)
        ray.get(cluster.router.update_pool.remote("decode", 1, 1))
        router = f"127.0.0.1:{cluster.ports['metrics_port']}"
        # Every labelled family has a sample once the poll has seen the store and a transfer.
        families = wait_for(
            lambda: (
                (f := scrape(router))["halfmoon_kv_transfer_bytes_total"]
                and f["halfmoon_store_blocks"]
                and f
            )
        )
        groups = json.loads(targets_file.read_text())
        assert groups == ray.get(cluster.router.metrics_targets.remote())
        actors = {g["labels"].get("worker") or g["labels"]["store_node"]: g for g in groups}
        worker_families = wait_for(
            lambda: (
                (f := scrape(actors["decode-1"]["targets"][0]))
                and f["halfmoon_engine_step_seconds"]
                and f
            )
        )
        store_name = next(name for name in actors if name.startswith("halfmoon-kvstore-"))
        store_families = scrape(actors[store_name]["targets"][0])
        worker_names = set(cluster.workers)
        frozen = {name: counters(cluster, name)["num_gc_frozen"] for name in worker_names}
    doc = documented()
    assert undocumented_or_mislabelled(families, doc["router"]) == []
    assert sorted(set(doc["router"]) - set(families)) == []
    assert undocumented_or_mislabelled(worker_families, doc["actor"]) == []
    assert undocumented_or_mislabelled(store_families, doc["actor"]) == []
    assert sorted(set(doc["actor"]) - set(worker_families)) == []
    assert {g["labels"]["role"] for g in groups} == {"prefill", "decode", "store"}
    assert {name for name in actors if not name.startswith("halfmoon-kvstore-")} == worker_names
    # Each worker froze its start-up heap (torch, transformers, the model: ~250k objects).
    assert min(frozen.values()) > 50_000, frozen
