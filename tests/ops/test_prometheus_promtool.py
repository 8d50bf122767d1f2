"""`promtool check config` accepts deploy/prometheus/prometheus.yml and the targets format."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed; `make test` installs it (deploy/system-deps.sh)")
    return binary


def check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )


def test_prometheus_config_passes_promtool():
    result = check(PROMETHEUS_DIR / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_router_and_the_controllers_targets():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["halfmoon-router"]["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    assert jobs["halfmoon-actors"]["file_sd_configs"][0]["files"] == ["targets/*.json"]


def test_documented_targets_file_format_passes_promtool(tmp_path):
    shutil.copy(PROMETHEUS_DIR / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(PROMETHEUS_DIR / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "targets").mkdir()
    sample = PROMETHEUS_DIR / "targets" / "example.json.sample"
    groups = json.loads(sample.read_text())
    (tmp_path / "targets" / "actors.json").write_text(json.dumps(groups))
    result = check(tmp_path / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "targets" / "actors.json").write_text('[{"targets": "not-a-list"}]')
    assert check(tmp_path / "prometheus.yml").returncode != 0
