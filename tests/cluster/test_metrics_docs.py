"""docs/metrics.md lists every metric the registry defines, under its exposed name."""

from __future__ import annotations

from pathlib import Path

from halfmoon.cluster.control.metrics import Metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
EXPOSED_SUFFIX = {"counter": "_total"}


def test_every_metric_is_documented():
    text = DOC.read_text()
    names = [
        family.name + EXPOSED_SUFFIX.get(family.type, "") for family in Metrics().registry.collect()
    ]
    assert [name for name in names if f"`{name}`" not in text] == []
