"""The Prometheus file_sd targets file: every worker's and store node's own /metrics, rewritten
atomically as actors come and go (deploy/prometheus/prometheus.yml reads targets/*.json)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class MetricsTargets:
    """Scrape targets by actor name; `path` None keeps them in memory only."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path).expanduser() if path else None
        self.groups: dict[str, dict] = {}

    def add(self, name: str, address: str, labels: dict[str, str]) -> None:
        self.groups[name] = {"targets": [address], "labels": labels}
        self._write()

    def remove(self, name: str) -> None:
        if self.groups.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        groups = [self.groups[name] for name in sorted(self.groups)]
        # Prometheus must never read a half-written file: write beside it, then rename.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".targets-", suffix=".tmp")
        with os.fdopen(fd, "w") as file:
            json.dump(groups, file, indent=1)
        os.replace(tmp, self.path)
