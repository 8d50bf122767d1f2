"""Every metric the Grafana dashboard queries is one halfmoon.cluster.control.metrics defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

from halfmoon.cluster.control.metrics import Metrics
from halfmoon.cluster.worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "halfmoon.json"
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "gauge": ("",),
}


def exposed_names() -> set[str]:
    """Every sample name the router's and a worker's registries can expose, labelled metrics
    without samples included."""
    names = set()
    families = [*Metrics().registry.collect(), *WorkerMetrics().registry.collect()]
    for family in families:
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def test_every_queried_metric_is_defined():
    dashboard = json.loads(DASHBOARD.read_text())
    defined = exposed_names()
    queried = {
        (panel["title"], name)
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        for name in re.findall(r"\b(?:halfmoon|process)_[a-z0-9_]+", target["expr"])
    }
    assert len(queried) > 20
    assert [(title, name) for title, name in sorted(queried) if name not in defined] == []


def test_dashboard_has_a_datasource_variable_every_panel_uses():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_covers_the_operational_views():
    titles = {panel["title"] for panel in panels(json.loads(DASHBOARD.read_text()))}
    for needed in (
        "Time to first token",
        "Inter-token latency",
        "Token throughput",
        "SLO attainment",
        "Rejections by reason",
        "Pool sizes",
        "KV usage per tier",
        "Prefix cache hit rate per tier",
        "KV transfer bandwidth",
        "TTFT prediction error",
    ):
        assert needed in titles


def test_every_query_filters_on_the_job_and_instance_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["job"]["query"]["query"] == 'label_values(up{job=~"halfmoon.*"}, job)'
    assert variables["instance"]["query"]["query"] == 'label_values(up{job=~"$job"}, instance)'
    for name in ("job", "instance"):
        assert variables[name]["multi"] and variables[name]["includeAll"]
    unfiltered = [
        (panel["title"], selector)
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        for selector in re.findall(
            r"\b(?:halfmoon|process)_[a-z0-9_]+(?:\{[^}]*\})?", target["expr"]
        )
        if 'job=~"$job", instance=~"$instance"' not in selector
    ]
    assert unfiltered == []
