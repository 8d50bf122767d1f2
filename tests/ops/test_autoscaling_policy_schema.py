"""A malformed autoscaling policy is rejected with the field and the reason; examples load."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.cluster.config import ConfigError, load_config, validate_config
from halfmoon.cluster.control.autoscaling_policy import DecodePlannerPolicy, PrefillTargetPolicy

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "autoscaling"


@pytest.mark.parametrize("name", ["prefill-queue", "decode-pages", "slo-planner"])
def test_example_policies_load(name):
    config = load_config(None, {"autoscaling": str(EXAMPLES / f"{name}.yaml")})
    assert config.autoscaling.prefill is not None or config.autoscaling.decode is not None


def test_example_kinds():
    planner = load_config(None, {"autoscaling": str(EXAMPLES / "slo-planner.yaml")})
    assert isinstance(planner.autoscaling.decode, DecodePlannerPolicy)
    queue = load_config(None, {"autoscaling": str(EXAMPLES / "prefill-queue.yaml")})
    assert isinstance(queue.autoscaling.prefill, PrefillTargetPolicy)


@pytest.mark.parametrize(
    ("pool", "policy", "expected"),
    [
        ("prefill", {"kind": "magic"}, "autoscaling.prefill.kind = 'magic': must be 'target' or"),
        ("prefill", {"target": 1}, "autoscaling.prefill.kind = None: must be 'target' or"),
        (
            "prefill",
            {"kind": "target", "target": 1, "signal": "pages_used_ratio"},
            "autoscaling.prefill.signal = 'pages_used_ratio': must be 'queue_s' or "
            "'waiting_tokens'",
        ),
        (
            "decode",
            {"kind": "target", "target": 1, "signal": "queue_s"},
            "autoscaling.decode.signal = 'queue_s': must be 'pages_used_ratio', "
            "'running_requests' or 'predicted_tbt_s'",
        ),
        ("decode", {"kind": "target"}, "autoscaling.decode.target: required"),
        (
            "decode",
            {"kind": "target", "target": 0},
            "autoscaling.decode.target = 0: must be greater",
        ),
        (
            "decode",
            {"kind": "target", "target": 2},
            "autoscaling.decode.target: 2.0 is a pages_used_ratio: a fraction in (0, 1]",
        ),
        (
            "decode",
            {"kind": "target", "target": 0.5, "min_replicas": 3, "max_replicas": 2},
            "autoscaling.decode.max_replicas: 2 is below min_replicas = 3",
        ),
        (
            "decode",
            {"kind": "target", "target": 0.5, "max_step": 0},
            "autoscaling.decode.max_step = 0: must be greater than or equal to 1",
        ),
        (
            "prefill",
            {"kind": "target", "target": 1, "cooldown": 5},
            "autoscaling.prefill.cooldown: unknown field; allowed here: min_replicas",
        ),
        (
            "prefill",
            {"kind": "slo_planner", "headroom": 0.5, "ttft_s": 1},
            "autoscaling.prefill.headroom = 0.5: must be greater than or equal to 1",
        ),
        (
            "prefill",
            {"kind": "slo_planner"},
            "autoscaling.prefill.ttft_s: slo_planner needs a TTFT target",
        ),
        (
            "decode",
            {"kind": "slo_planner"},
            "autoscaling.decode.tbt_s: slo_planner derives decode throughput at the TBT target",
        ),
    ],
)
def test_malformed_policy_names_field_and_reason(pool, policy, expected):
    with pytest.raises(ConfigError) as caught:
        validate_config({"autoscaling": {pool: policy}})
    assert expected in str(caught.value)


def test_malformed_policy_file_is_rejected_with_its_field(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("decode:\n  kind: target\n  target: 0.5\n  upscale_delay_s: -1\n")
    with pytest.raises(ConfigError, match=r"autoscaling\.decode\.upscale_delay_s = -1: must be"):
        load_config(None, {"autoscaling": str(path)})


def test_a_missing_policy_file_is_named():
    with pytest.raises(ConfigError, match="autoscaling = 'absent.yaml': absent.yaml is not a file"):
        load_config(None, {"autoscaling": "absent.yaml"})
