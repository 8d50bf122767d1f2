from __future__ import annotations

import asyncio
import logging
import pickle

import pytest
import redis
from kv_helpers import LAYOUT, assert_same, make_keys, random_kv
from redis.asyncio.connection import SSLConnection

from halfmoon.kvstore.codec import encode_layer
from halfmoon.kvstore.redis_tier import RedisTier

pytestmark = pytest.mark.anyio


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


async def test_round_trip_is_bit_exact_with_ttl(redis_url: str) -> None:
    tier, keys, kv = RedisTier(redis_url, LAYOUT, ttl_s=120), make_keys(3), random_kv(3)
    assert await tier.put_layer(keys, 2, kv)
    hits = await tier.get_layer(keys, 2)
    assert hits.indices == [0, 1, 2]
    assert_same(hits.kv, kv)
    assert 0 < sync_client(redis_url).ttl(tier.record_key(keys[0], 2)) <= 120
    await tier.close()


async def test_missing_blocks_are_reported_by_index(redis_url: str) -> None:
    tier, keys = RedisTier(redis_url, LAYOUT), make_keys(3)
    await tier.put_layer([keys[1]], 0, random_kv(1, 5))
    hits = await tier.get_layer(keys, 0)
    assert hits.indices == [1]
    assert_same(hits.kv, random_kv(1, 5))
    assert (tier.stats.hits, tier.stats.misses) == (1, 2)
    await tier.close()


def malicious_values(key: bytes) -> dict[str, bytes]:
    class Payload:
        def __reduce__(self):
            return (print, ("unpickled!",))

    good = encode_layer([key], 0, random_kv(1))
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    return {
        "pickle": pickle.dumps(Payload()),
        "garbage": b"\x00" * 100,
        "truncated": good[:-10],
        "flipped": bytes(flipped),
        "other_key": encode_layer(make_keys(1), 0, random_kv(1)),
        "other_layer": encode_layer([key], 1, random_kv(1)),
        "other_shape": encode_layer([key], 0, random_kv(1, layout=LAYOUT.__class__(3, 8, 2, 8))),
    }


@pytest.mark.parametrize("kind", list(malicious_values(b"k" * 16)))
@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
async def test_corrupt_record_is_a_miss_and_deleted(redis_url: str, kind: str, sealed) -> None:
    """Unsealed: the MAC rejects it. Sealed with the tier's key: the codec's checks do."""
    tier, key = RedisTier(redis_url, LAYOUT), make_keys(1)[0]
    name = tier.record_key(key, 0)
    value = malicious_values(key)[kind]
    sync_client(redis_url).set(name, tier.seal(name, value) if sealed else value)
    hits = await tier.get_layer([key], 0)
    assert hits.indices == [] and hits.kv is None and hits.corrupt_keys == [key]
    assert (tier.stats.corrupt, tier.stats.forged) == (1, 0 if sealed else 1)
    assert sync_client(redis_url).exists(name) == 0
    await tier.close()


async def test_forged_record_with_valid_checksum_is_rejected_and_logged_once(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = RedisTier(redis_url, LAYOUT, hmac_key=b"cluster-key-0123456789")
    forger = RedisTier(redis_url, LAYOUT, hmac_key=b"another-key-0123456789")
    keys, forged_kv = make_keys(2), random_kv(2, seed=7)
    assert await forger.put_layer(keys, 0, forged_kv)  # well formed, valid CRC, wrong key
    with caplog.at_level(logging.WARNING, logger="halfmoon.kvstore.redis_tier"):
        hits = await tier.get_layer(keys, 0)
    assert hits.indices == [] and hits.kv is None and hits.corrupt_keys == keys
    assert (tier.stats.forged, tier.stats.corrupt, tier.stats.hits) == (2, 2, 0)
    assert sum("HMAC does not match" in r.message for r in caplog.records) == 1
    assert "cluster-key" not in caplog.text
    same_key = RedisTier(redis_url, LAYOUT, hmac_key=b"cluster-key-0123456789")
    assert await same_key.put_layer(keys, 0, random_kv(2))
    assert_same((await tier.get_layer(keys, 0)).kv, random_kv(2))
    for t in (tier, forger, same_key):
        await t.close()


async def test_password_parameter_authenticates(redis_server, redis_url: str) -> None:
    admin = sync_client(redis_url)
    admin.config_set("requirepass", "pw-param")
    try:
        tier, keys, kv = (
            RedisTier(redis_url, LAYOUT, password="pw-param"),
            make_keys(1),
            random_kv(1),
        )
        assert await tier.put_layer(keys, 0, kv)
        assert_same((await tier.get_layer(keys, 0)).kv, kv)
        await tier.close()
        anonymous = RedisTier(redis_url, LAYOUT)
        assert not await anonymous.put_layer(keys, 0, kv)
        assert anonymous.stats.errors == 1
        await anonymous.close()
    finally:
        admin.execute_command("AUTH", "pw-param")
        admin.config_set("requirepass", "")


async def test_many_concurrent_calls_share_a_small_pool_without_going_down(
    redis_url: str,
) -> None:
    key = b"pool-test-key-0123456789"
    tier = RedisTier(redis_url, LAYOUT, hmac_key=key, max_connections=2, pool_timeout_s=30)
    batches = [make_keys(4) for _ in range(100)]
    stored = await asyncio.gather(*(tier.put_layer(keys, 0, random_kv(4)) for keys in batches))
    found = await asyncio.gather(*(tier.get_layer(keys, 0) for keys in batches))
    assert all(stored) and all(hits.indices == [0, 1, 2, 3] for hits in found)
    assert tier.available and (tier.stats.errors, tier.stats.pool_timeouts) == (0, 0)
    assert len(tier.client.connection_pool._in_use_connections) == 0
    assert tier.client.connection_pool.max_connections == 2
    await tier.close()


async def test_waiting_past_the_pool_timeout_is_a_miss_not_an_outage(redis_url: str) -> None:
    tier = RedisTier(redis_url, LAYOUT, max_connections=1, pool_timeout_s=0.05)
    keys = make_keys(1)
    held = await tier.client.connection_pool.get_connection()
    try:
        hits = await tier.get_layer(keys, 0)
        assert hits.indices == [] and tier.stats.pool_timeouts == 1
        assert tier.available and tier.stats.errors == 0
    finally:
        await tier.client.connection_pool.release(held)
    assert await tier.put_layer(keys, 0, random_kv(1))
    await tier.close()


async def test_outage_gives_misses_one_warning_and_reconnects(
    redis_server, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier, keys, kv = RedisTier(redis_url, LAYOUT, retry_interval_s=0), make_keys(2), random_kv(2)
    assert await tier.put_layer(keys, 0, kv)
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="halfmoon.kvstore.redis_tier"):
            assert (await tier.get_layer(keys, 0)).indices == []
            assert not await tier.put_layer(keys, 1, kv)
            assert await tier.exists(keys, 0) == [False, False]
        assert not tier.available
        assert sum("unreachable" in r.message for r in caplog.records) == 1
    finally:
        redis_server.start()
    assert await tier.put_layer(keys, 1, kv)
    assert tier.available
    assert_same((await tier.get_layer(keys, 1)).kv, kv)
    await tier.close()


async def test_down_tier_waits_retry_interval_before_trying_again(redis_server) -> None:
    class Clock:
        now_s = 0.0

        def __call__(self) -> float:
            return self.now_s

    clock = Clock()
    tier = RedisTier("redis://127.0.0.1:1/0", LAYOUT, retry_interval_s=5, clock=clock)
    await tier.get_layer(make_keys(1), 0)
    assert tier.stats.errors == 1
    await tier.get_layer(make_keys(1), 0)
    assert tier.stats.errors == 1
    clock.now_s = 5.0
    await tier.get_layer(make_keys(1), 0)
    assert tier.stats.errors == 2
    await tier.close()


async def test_url_with_password_authenticates(redis_server, redis_url: str) -> None:
    admin = sync_client(redis_url)
    admin.config_set("requirepass", "s3cret")
    try:
        url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/0"
        tier, keys, kv = RedisTier(url, LAYOUT), make_keys(1), random_kv(1)
        assert await tier.put_layer(keys, 0, kv)
        assert_same((await tier.get_layer(keys, 0)).kv, kv)
        await tier.close()
        assert not await RedisTier(redis_url, LAYOUT).put_layer(keys, 0, kv)
    finally:
        admin.execute_command("AUTH", "s3cret")
        admin.config_set("requirepass", "")


def test_rediss_url_uses_tls_connections() -> None:
    tier = RedisTier("rediss://user:pw@cache.example:6380/1", LAYOUT)
    assert tier.client.connection_pool.connection_class is SSLConnection
    assert tier.client.connection_pool.connection_kwargs["password"] == "pw"


async def test_server_lru_eviction_turns_old_blocks_into_misses(redis_url: str) -> None:
    admin = sync_client(redis_url)
    admin.config_set("maxmemory", "2mb")
    try:
        tier = RedisTier(redis_url, LAYOUT)
        batches = [make_keys(64) for _ in range(200)]
        for keys in batches:
            assert await tier.put_layer(keys, 0, random_kv(64))
        found = [len((await tier.get_layer(keys, 0)).indices) for keys in reversed(batches)]
        # Redis samples its LRU, so assert the trend, not an exact cut.
        assert found[0] >= 48 and sum(found[:50]) > 4 * sum(found[-50:])
        assert tier.stats.errors == 0 and tier.available
        await tier.close()
    finally:
        admin.config_set("maxmemory", "256mb")


def test_local_redis_server_with_password_refuses_anonymous_clients(tmp_path) -> None:
    from halfmoon.kvstore.redis_server import start_redis_server

    process, url = start_redis_server(workdir=str(tmp_path), password="local-secret")
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            sync_client(url).ping()
        assert redis.Redis.from_url(url, password="local-secret").ping()
        with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
            assert b"local-secret" not in cmdline.read()
    finally:
        process.terminate()
        process.wait(timeout=10)
