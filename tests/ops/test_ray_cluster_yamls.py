"""The `ray up` cluster YAMLs pass Ray's own config preparation and schema validation."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

RAY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "ray"


def load(name: str) -> dict:
    return yaml.safe_load((RAY_DIR / name).read_text())


def ray_up_validation(config: dict) -> dict:
    """What `ray up` does before touching a cloud: fill defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_aws_yaml_is_valid_with_prefill_and_decode_gpu_node_types():
    prepared = ray_up_validation(load("aws.yaml"))
    types = prepared["available_node_types"]
    assert types["prefill_gpu"]["resources"] == {"prefill": 1}
    assert types["decode_gpu"]["resources"] == {"decode": 1}
    for name in ("prefill_gpu", "decode_gpu"):
        assert 0 <= types[name]["min_workers"] <= types[name]["max_workers"]
    assert any("pip install" in command for command in prepared["setup_commands"])
    assert prepared["head_start_ray_commands"] and prepared["worker_start_ray_commands"]


def test_onprem_yaml_is_valid_and_gives_each_host_a_role():
    config = load("onprem.yaml")
    assert config["provider"]["type"] == "local"
    prepared = ray_up_validation(config)
    assert prepared["provider"]["worker_ips"]
    start = " ".join(prepared["worker_start_ray_commands"])
    assert "--resources=" in start and "ROLE=prefill" in start and "ROLE=decode" in start


def test_validation_catches_a_broken_config():
    config = load("aws.yaml")
    config["available_node_types"]["prefill_gpu"]["min_wrokers"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_wrokers"):
        ray_up_validation(config)
