"""Fixtures for the KV store tests: a small layout, random blocks and a flushed Redis."""

from __future__ import annotations

import pytest
import redis
from kv_helpers import LAYOUT

from halfmoon.kvstore.layout import KvLayout


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def layout() -> KvLayout:
    return LAYOUT


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session redis-server, running and empty."""
    if redis_server.process is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url
