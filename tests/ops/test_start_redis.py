"""deploy/ray/start-redis.sh, run for real: the cluster's Redis tier answers only with the
password make-secrets.sh wrote, in protected mode, on the node's address and loopback."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from halfmoon.kvstore.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _client(port: int, password: str | None = None) -> redis.Redis:
    """No retries: a refused password fails at once (redis-py retries it for 4 s)."""
    return redis.Redis(host="127.0.0.1", port=port, password=password, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def deploy(tmp_path):
    """A copy of deploy/ray (its scripts find secrets/ beside them) with fresh secrets."""
    copy = tmp_path / "ray"
    copy.mkdir()
    for script in ("make-secrets.sh", "start-redis.sh"):
        shutil.copy(ROOT / "deploy" / "ray" / script, copy / script)
    subprocess.run(["bash", copy / "make-secrets.sh"], check=True, capture_output=True)
    return copy


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="make test installs redis-server")
def test_the_redis_tier_needs_the_generated_password(deploy):
    secrets = deploy / "secrets"
    assert all((secrets / name).stat().st_mode & 0o077 == 0 for name in secrets.iterdir())
    password = (secrets / "redis-password").read_text().strip()
    port = free_port()
    started = subprocess.run(
        ["bash", deploy / "start-redis.sh", str(port), "64mb"], capture_output=True, text=True
    )
    assert started.returncode == 0, started.stderr
    assert password not in started.stdout, "the URL it prints names the file, not the secret"
    client = _client(port, password)
    try:
        client.ping()
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert client.config_get("save") == {"save": ""}
        bound = client.config_get("bind")["bind"].split()
        assert "127.0.0.1" in bound and len(bound) == 2, "the node's address and loopback"
        with pytest.raises(redis.AuthenticationError):
            _client(port).ping()
        with pytest.raises(redis.AuthenticationError):
            _client(port, "guess").ping()
        # A second start (a restart of the head) replaces it rather than failing.
        again = subprocess.run(
            ["bash", deploy / "start-redis.sh", str(port), "64mb"], capture_output=True, text=True
        )
        assert again.returncode == 0, again.stderr
    finally:
        with contextlib.suppress(redis.ConnectionError):  # shutting down closes the connection
            _client(port, password).shutdown(nosave=True)


def test_without_secrets_it_says_what_to_run(tmp_path):
    shutil.copy(ROOT / "deploy" / "ray" / "start-redis.sh", tmp_path / "start-redis.sh")
    failed = subprocess.run(
        ["bash", tmp_path / "start-redis.sh", "6399"], capture_output=True, text=True, timeout=30
    )
    assert failed.returncode == 1 and "run deploy/ray/make-secrets.sh first" in failed.stderr
