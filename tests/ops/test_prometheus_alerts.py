"""The alert rules pass `promtool check rules`, and `promtool test rules` shows each one firing
on the series it is meant for and silent on healthy ones (tests/ops/alerts_test.yml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yml")
ALERTS = {
    "HalfmoonTTFTSLOBurn",
    "HalfmoonRequestsRejected",
    "HalfmoonPoolEmpty",
    "HalfmoonKVTransferStalled",
    "HalfmoonTargetDown",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (deploy/system-deps.sh installs it)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def test_alert_rules_pass_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


def test_every_alert_fires_in_the_promtool_unit_tests():
    result = promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == ALERTS


def test_prometheus_loads_the_rules_and_every_alert_is_documented():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {rule["alert"] for rule in rules} == ALERTS
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert [name for name in sorted(ALERTS) if f"`{name}`" not in doc] == []
