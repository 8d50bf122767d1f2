"""The store node's two halves in process: the block store (tiers, leases, events) and the
layer streams over it (reads that wait for layers still being put)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from kv_helpers import LAYOUT, assert_same, make_keys, random_kv

from halfmoon.kvstore.blocks import BlockStore
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.errors import LayerTimeout, StoreFull
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.streams import LayerStreams
from halfmoon.router.prefix_index import PrefixIndex

pytestmark = pytest.mark.anyio


def store(num_blocks: int = 8, redis_url: str | None = None, **config) -> BlockStore:
    """A block store of `num_blocks` that evicts only once full."""
    capacity = num_blocks * LAYOUT.block_bytes
    watermarks = dict(high_watermark=1.0, low_watermark=1.0)
    settings = dict(host_capacity_bytes=capacity, redis_url=redis_url, redis_retry_interval_s=0)
    return BlockStore(LAYOUT, StoreConfig(**(settings | watermarks | config)), instance="node0")


def put_all_layers(blocks: BlockStore, keys: list[bytes], seed: int = 0) -> None:
    for layer in range(LAYOUT.num_layers):
        blocks.put_layer(keys, layer, random_kv(len(keys), seed + layer))


async def test_put_then_get_every_layer_is_bit_exact() -> None:
    blocks, keys = store(), make_keys(3)
    streams = LayerStreams(blocks)
    put_all_layers(blocks, keys, seed=7)
    for layer in range(LAYOUT.num_layers):
        assert_same(await streams.get_layer(keys, layer, timeout_s=0), random_kv(3, 7 + layer))
    stats = blocks.stats()
    assert (stats.host.hits, stats.host.misses, stats.host.blocks) == (9, 0, 3)
    assert stats.put_latency.count == 3 and streams.latency().count == 3


async def test_get_layer_waits_for_a_later_put_layer() -> None:
    blocks, keys = store(), make_keys(2)
    streams = LayerStreams(blocks)
    blocks.put_layer(keys[:1], 1, random_kv(1, 1))
    getter = asyncio.create_task(streams.get_layer(keys, 1, timeout_s=30))
    await asyncio.sleep(0)  # the getter now waits for the second block's layer 1
    blocks.put_layer(keys, 0, random_kv(2, 0))
    await asyncio.sleep(0)
    assert not getter.done()
    blocks.put_layer(keys[1:], 1, random_kv(1, 2))
    got = await getter
    assert_same(LayerKV(got.k[:1], got.v[:1]), random_kv(1, 1))
    assert_same(LayerKV(got.k[1:], got.v[1:]), random_kv(1, 2))


async def test_stream_layers_yields_unit_by_unit_layer_by_layer_as_each_is_put() -> None:
    blocks, first, second = store(), make_keys(2), make_keys(1)
    stream = LayerStreams(blocks).stream_layers([first, second], LAYOUT.num_layers, timeout_s=30)
    blocks.put_layer(first, 0, random_kv(2, 0))
    assert_same(await anext(stream), random_kv(2, 0))
    ahead = asyncio.create_task(anext(stream))  # layer 1 of the first unit is not put yet
    blocks.put_layer(second, 0, random_kv(1, 10))  # a later unit first: no effect
    await asyncio.sleep(0)
    assert not ahead.done()
    for layer in range(1, LAYOUT.num_layers):
        blocks.put_layer(first, layer, random_kv(2, layer))
    assert_same(await ahead, random_kv(2, 1))
    assert_same(await anext(stream), random_kv(2, 2))
    assert_same(await anext(stream), random_kv(1, 10))
    for layer in range(1, LAYOUT.num_layers):
        blocks.put_layer(second, layer, random_kv(1, 10 + layer))
    assert [got.shape for got in [kv async for kv in stream]] == [(1, *LAYOUT.page_shape)] * 2
    assert blocks.stats().host.leased_blocks == 0


async def test_a_stream_times_out_per_layer_and_holds_no_lease_after() -> None:
    blocks, keys = store(), make_keys(2)
    blocks.put_layer(keys, 0, random_kv(2, 0))
    stream = LayerStreams(blocks).stream_layers([keys], LAYOUT.num_layers, timeout_s=0.05)
    await anext(stream)
    with pytest.raises(LayerTimeout, match="layer 1"):
        await anext(stream)
    for layer in range(1, LAYOUT.num_layers):  # complete: the producer's own lease ends
        blocks.put_layer(keys, layer, random_kv(2, layer))
    assert blocks.stats().host.leased_blocks == 0


async def test_get_layer_timeout_names_the_layer_and_releases_its_lease() -> None:
    blocks, keys = store(num_blocks=2), make_keys(2)
    put_all_layers(blocks, keys[:1])
    with pytest.raises(LayerTimeout, match="layer 2: 1 of 2 blocks were not put within"):
        await LayerStreams(blocks).get_layer(keys, 2, timeout_s=0.05)
    assert blocks.stats().host.leased_blocks == 0
    put_all_layers(blocks, make_keys(2))
    assert blocks.cached_prefix(keys) == 0


async def test_timeout_zero_is_an_immediate_miss() -> None:
    with pytest.raises(LayerTimeout, match="within 0.000 s"):
        await LayerStreams(store()).get_layer(make_keys(1), 0, timeout_s=0)


async def test_a_slot_stream_ended_by_its_reader_releases_what_it_sent_ahead() -> None:
    blocks, keys = store(), make_keys(2)
    streams = LayerStreams(blocks)
    put_all_layers(blocks, keys)
    stream = streams.stream_slots([keys], LAYOUT.num_layers, timeout_s=0, stream_id="reader")
    (slots, lease_id), (again, another) = await anext(stream), await anext(stream)
    assert slots == again and lease_id != another  # one unit's slots, a lease per layer
    assert blocks.stats().host.leased_blocks == 2
    streams.end_stream("reader")
    assert blocks.stats().host.leased_blocks == 0
    assert [item async for item in stream] == []  # an ended stream grants no more
    assert blocks.stats().host.leased_blocks == 0


async def test_next_arrival_is_set_by_a_put_of_its_own_layer() -> None:
    blocks, keys = store(), make_keys(1)
    arrival = blocks.next_arrival(1)
    blocks.put_layer(keys, 0, random_kv(1, 0))
    assert not arrival.is_set()
    blocks.put_layer(keys, 1, random_kv(1, 1))
    assert arrival.is_set() and not blocks.next_arrival(1).is_set()


async def test_a_shared_host_tier_tells_where_producers_map_it() -> None:
    info = store().arena_info("node-a")
    assert info is not None and (info.node_id, info.num_slots) == ("node-a", 8)
    assert store(shared_arena=False).arena_info("node-a") is None


async def test_lease_protects_blocks_and_store_full_when_all_leased() -> None:
    blocks, keys = store(num_blocks=2), make_keys(2)
    put_all_layers(blocks, keys)
    lease_id = blocks.lease(keys, ttl_s=60)
    with pytest.raises(StoreFull):
        blocks.put_layer(make_keys(1), 0, random_kv(1))
    assert blocks.release(lease_id)
    blocks.put_layer(make_keys(1), 0, random_kv(1))
    assert blocks.cached_prefix(keys) == 0


async def test_events_feed_a_prefix_index() -> None:
    blocks, index = store(num_blocks=3), PrefixIndex()
    first, second = make_keys(2), make_keys(2)
    put_all_layers(blocks, first)
    put_all_layers(blocks, second)
    for event in blocks.drain_events():
        index.apply(event)
    assert index.longest_prefix(first) == {}
    assert index.longest_prefix(second) == {("node0", "host"): 2}
    assert blocks.drain_events() == []


async def test_a_snapshot_lists_what_the_tiers_hold_now_and_supersedes_the_events() -> None:
    # What a router that starts afresh builds its index from (after the old one's death).
    blocks, index = store(num_blocks=3), PrefixIndex()
    first, second = make_keys(2), make_keys(2)
    put_all_layers(blocks, first)
    put_all_layers(blocks, second)  # evicts the first chain
    for event in blocks.snapshot():
        index.apply(event)
    assert index.longest_prefix(first) == {}
    assert index.longest_prefix(second) == {("node0", "host"): 2}
    assert blocks.drain_events() == []  # the snapshot has them


async def test_eviction_demotes_to_redis_and_a_hit_promotes_back(redis_url: str) -> None:
    blocks, old, new = store(num_blocks=2, redis_url=redis_url), make_keys(2), make_keys(2)
    streams = LayerStreams(blocks)
    put_all_layers(blocks, old, seed=3)
    put_all_layers(blocks, new)
    await blocks.flush()
    assert blocks.cached_prefix(old) == 0
    stats = blocks.stats()
    assert (stats.demotions, stats.host.evictions) == (2, 2)
    for layer in range(LAYOUT.num_layers):
        assert_same(await streams.get_layer(old, layer, timeout_s=0), random_kv(2, 3 + layer))
    stats = blocks.stats()
    assert stats.promotions == 6 and stats.redis.hits == 6
    assert blocks.cached_prefix(old) == 2
    kinds = {(e.kind, e.tier) for e in blocks.drain_events()}
    assert ("stored", "redis") in kinds and ("evicted", "host") in kinds
    await blocks.close()


async def test_redis_killed_and_restarted_costs_hits_never_requests(
    redis_server, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    blocks, keys = store(num_blocks=1, redis_url=redis_url), make_keys(4)
    streams = LayerStreams(blocks)
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="halfmoon.kvstore.redis_tier"):
            put_all_layers(blocks, keys[:1])
            put_all_layers(blocks, keys[1:2])
            await blocks.flush()
            with pytest.raises(LayerTimeout):
                await streams.get_layer(keys[:1], 0, timeout_s=0)
        stats = blocks.stats()
        assert stats.demotions_dropped == 1 and not stats.redis_available
        assert sum("unreachable" in r.message for r in caplog.records) == 1
    finally:
        redis_server.start()
    put_all_layers(blocks, keys[2:3], seed=5)
    put_all_layers(blocks, keys[3:4])
    await blocks.flush()
    assert_same(await streams.get_layer(keys[2:3], 0, timeout_s=0), random_kv(1, 5))
    assert blocks.stats().redis_available
    await blocks.close()


async def test_store_nodes_sharing_a_mac_key_and_password_read_each_others_blocks(
    redis_url: str,
) -> None:
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.config_set("requirepass", "store-pw")
    try:
        secrets = {"redis_password": "store-pw", "redis_hmac_key": "shared-cluster-key-01"}
        writer, reader = store(2, redis_url, **secrets), store(2, redis_url, **secrets)
        stranger = store(2, redis_url, redis_password="store-pw")  # its own random MAC key
        old = make_keys(2)
        put_all_layers(writer, old, seed=3)
        put_all_layers(writer, make_keys(2))
        await writer.flush()
        assert writer.stats().demotions == 2
        assert_same(await LayerStreams(reader).get_layer(old, 0, timeout_s=0), random_kv(2, 3))
        assert reader.stats().redis.hits == 2 and reader.stats().redis.forged == 0
        with pytest.raises(LayerTimeout):
            await LayerStreams(stranger).get_layer(old, 1, timeout_s=0)
        assert stranger.stats().redis.forged == 2
        for blocks in (writer, reader, stranger):
            await blocks.close()
    finally:
        admin.execute_command("AUTH", "store-pw")
        admin.config_set("requirepass", "")


async def test_an_idle_store_reports_an_expired_lease_as_gone() -> None:
    now = [0.0]
    blocks = BlockStore(LAYOUT, StoreConfig(), instance="node0", clock=lambda: now[0])
    keys = make_keys(3)
    put_all_layers(blocks, keys)
    blocks.lease(keys, ttl_s=30)
    assert blocks.stats().host.leased_blocks == 3
    now[0] = 31.0  # nothing else happens: no grant, no put
    assert blocks.stats().host.leased_blocks == 0


async def test_a_prefix_in_redis_with_no_room_to_promote_it_is_a_miss(redis_url: str) -> None:
    blocks, keys = store(num_blocks=2, redis_url=redis_url), make_keys(4)
    put_all_layers(blocks, keys[:2])
    put_all_layers(blocks, keys[2:], seed=7)  # evicts the first two to Redis
    await blocks.flush()
    blocks.lease(keys[2:])  # every host block leased: nothing can make room
    assert await blocks.prefix_depths(keys[:2]) == (0, 0)  # was StoreFull, a 500 when served


async def test_prefix_depths_promotes_what_only_redis_holds(redis_url: str) -> None:
    blocks, keys = store(num_blocks=2, redis_url=redis_url), make_keys(4)
    put_all_layers(blocks, keys[:2])
    put_all_layers(blocks, keys[2:], seed=7)  # evicts the first two to Redis
    await blocks.flush()
    assert await blocks.prefix_depths(keys[2:]) == (2, 0)
    # The first two are only in Redis: promoted into the host tier (which holds two blocks).
    assert await blocks.prefix_depths(keys) == (0, 2)
    assert await blocks.prefix_depths(keys[:2]) == (2, 0)
    assert await blocks.prefix_depths(make_keys(2)) == (0, 0)
