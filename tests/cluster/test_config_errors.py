"""A bad config is one ConfigError naming, per line, the field path, the value and the fix."""

from __future__ import annotations

import pytest

from halfmoon.cluster.config import ConfigError, validate_config


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    return str(caught.value)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"mode": "split"}, "mode = 'split': must be 'disaggregated' or 'colocated'"),
        (
            {"engine": {"blok_size": 16}},
            "engine.blok_size: unknown field; allowed here: block_size, num_pages,",
        ),
        (
            {"engine": {"block_size": 0}},
            "engine.block_size = 0: must be greater than or equal to 1",
        ),
        ({"engine": {"dtype": "int8"}}, "engine.dtype = 'int8': must be 'auto', 'float32'"),
        ({"prefill": {"replicas": "two"}}, "prefill.replicas = 'two': must be a valid integer"),
        ({"slo": {"ttft_s": -1}}, "slo.ttft_s = -1: must be greater than 0"),
        ({"server": {"grpc_port": 70000}}, "server.grpc_port = 70000: must be less than or equal"),
        (
            {"router": {"policy": "fastest"}},
            "router.policy = 'fastest': must be one of random, round_robin, least_loaded",
        ),
        (
            {"router": {"profile": "nope"}},
            "router.profile = 'nope': must be a profile file or one of",
        ),
        (
            {"store": {"redis_url": "http://x"}},
            "store.redis_url = 'http://x': must start with redis://",
        ),
        (
            {"prefill": {"resources": {"prefill": -1}}},
            "prefill.resources.prefill: -1.0 must be >= 0",
        ),
    ],
)
def test_a_bad_value_names_path_value_and_what_is_allowed(data, expected):
    assert expected in error_of(data)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"engine": {"prefill_chunk_size": 40}},
            "engine.prefill_chunk_size: 40 must be a multiple of block_size = 16",
        ),
        (
            {"engine": {"prefill_chunk_size": 4096}},
            "engine.prefill_chunk_size: 4096 exceeds max_num_batched_tokens = 2048",
        ),
        (
            {"router": {"admission": "early_rejection"}},
            "router.admission: 'early_rejection' rejects against an SLO; set slo.ttft_s",
        ),
        ({"decode": {"replicas": 0}}, "decode.replicas: 0 must be >= 1"),
        (
            {"prefill": {"replicas": 0}},
            "prefill.replicas: 0 must be >= 1 in disaggregated mode (or set mode: colocated)",
        ),
        (
            {"server": {"metrics_port": 50051}},
            "server.metrics_port: 50051 is also grpc_port",
        ),
        (
            {"mode": "colocated", "autoscaling": {"prefill": {"kind": "target", "target": 1}}},
            "autoscaling.prefill: colocated mode has no prefill pool",
        ),
        (
            {
                "prefill": {"replicas": 5},
                "autoscaling": {"prefill": {"kind": "target", "target": 1}},
            },
            "prefill.replicas: 5 is outside autoscaling.prefill's [1, 4]",
        ),
    ],
)
def test_a_cross_field_conflict_names_the_field_to_fix(data, expected):
    assert expected in error_of(data)


def test_every_bad_field_gets_its_own_line():
    message = error_of({"mode": "x", "slo": {"tbt_s": 0}, "health": {"interval_s": -1}})
    lines = message.splitlines()
    assert lines[0] == "config is invalid:"
    assert [line.split(" ")[2] for line in lines[1:]] == ["mode", "slo.tbt_s", "health.interval_s"]


def test_a_short_redis_hmac_key_is_refused_without_echoing_it():
    message = error_of({"store": {"redis_hmac_key": "tiny-secret"}})
    assert "store.redis_hmac_key: must be at least 16 characters" in message
    assert "tiny-secret" not in message


def test_secrets_do_not_show_in_the_config_repr():
    config = validate_config({"store": {"redis_password": "pw-123", "redis_hmac_key": "k" * 32}})
    assert "pw-123" not in repr(config) and "k" * 32 not in repr(config)


def test_tls_needs_both_files(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    assert "server.tls_key: give tls_cert and tls_key together" in error_of(
        {"server": {"tls_cert": str(cert)}}
    )
    missing = error_of({"server": {"tls_cert": str(cert), "tls_key": str(tmp_path / "no.pem")}})
    assert "server.tls_key: " in missing and "no.pem is not a file" in missing


def test_queue_bound_admission_is_the_default_and_needs_no_slo():
    config = validate_config({})
    assert (config.router.admission, config.router.max_queued_per_worker) == ("queue_bound", 64)
