from __future__ import annotations

import pytest
from kv_helpers import LAYOUT, assert_same, make_keys, random_kv

from halfmoon.kvstore.errors import LayoutMismatch, StoreFull
from halfmoon.kvstore.host_tier import HostTier
from halfmoon.kvstore.layout import LayerKV


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def tier(num_blocks: int, high: float = 1.0, low: float = 1.0, **kwargs) -> HostTier:
    return HostTier(LAYOUT, num_blocks * LAYOUT.block_bytes, high, low, **kwargs)


def put_blocks(host: HostTier, keys: list[bytes], seed: int = 0) -> None:
    for layer in range(LAYOUT.num_layers):
        host.write_layer(keys, layer, random_kv(len(keys), seed + layer))


def test_round_trip_is_bit_exact_per_layer() -> None:
    host, keys = tier(4), make_keys(3)
    payloads = [random_kv(3, seed) for seed in range(LAYOUT.num_layers)]
    for layer, kv in enumerate(payloads):
        host.write_layer(keys, layer, kv)
    for layer, kv in enumerate(payloads):
        assert_same(host.read_layer(keys, layer), kv)
    reversed_kv = LayerKV(payloads[0].k.flip(0), payloads[0].v.flip(0))
    assert_same(host.read_layer(keys[::-1], 0), reversed_kv)


def test_block_completes_only_when_every_layer_is_put() -> None:
    host, keys = tier(2), make_keys(1)
    results = [host.write_layer(keys, layer, random_kv(1)) for layer in range(LAYOUT.num_layers)]
    assert [r.completed for r in results] == [[], [], keys]
    assert keys[0] in host and host.leading_complete(keys + make_keys(1)) == 1


def test_eviction_takes_least_recently_used_first() -> None:
    host = tier(3)
    a, b, c, d = make_keys(4)
    for key in (a, b, c):
        put_blocks(host, [key])
    host.read_layer([a], 0)
    evicted = host.write_layer([d], 0, random_kv(1)).evicted
    assert [block.key for block in evicted] == [b]
    assert a in host and c in host and b not in host


def test_watermarks_evict_from_high_down_to_low() -> None:
    host = tier(10, high=0.8, low=0.5)
    keys = make_keys(9)
    for key in keys[:8]:
        put_blocks(host, [key])
    assert host.usage().used_blocks == 8
    result = host.write_layer([keys[8]], 0, random_kv(1))
    assert [block.key for block in result.evicted] == keys[:4]
    assert host.usage().used_blocks == 5


def test_evicted_complete_block_carries_its_bytes_when_kept() -> None:
    host = tier(1, keep_evicted_data=True)
    first, second = make_keys(2)
    put_blocks(host, [first], seed=10)
    evicted = host.write_layer([second], 0, random_kv(1)).evicted
    assert evicted[0].key == first and evicted[0].data is not None
    assert evicted[0].data.numel() == LAYOUT.block_bytes


def test_lease_blocks_eviction_until_released() -> None:
    host = tier(2)
    a, b, c = make_keys(3)
    put_blocks(host, [a])
    put_blocks(host, [b])
    lease_id = host.lease([a], ttl_s=60)
    evicted = host.write_layer([c], 0, random_kv(1)).evicted
    assert [block.key for block in evicted] == [b]
    assert host.release(lease_id) and not host.release(lease_id)


def test_lease_expires_after_its_ttl() -> None:
    clock = FakeClock()
    host = tier(1, clock=clock)
    a, b = make_keys(2)
    put_blocks(host, [a])
    host.lease([a], ttl_s=5)
    with pytest.raises(StoreFull):
        host.write_layer([b], 0, random_kv(1))
    clock.now_s = 5.0
    assert [block.key for block in host.write_layer([b], 0, random_kv(1)).evicted] == [a]


def test_every_block_leased_raises_store_full_with_counts() -> None:
    host = tier(2)
    keys = make_keys(2)
    put_blocks(host, keys)
    host.lease(keys, ttl_s=60)
    with pytest.raises(StoreFull, match="needs 1 free blocks but only 0 can be evicted"):
        host.write_layer(make_keys(1), 0, random_kv(1))


def test_half_written_block_is_not_evicted_until_pending_ttl() -> None:
    clock = FakeClock()
    host = tier(1, pending_ttl_s=10, clock=clock)
    a, b = make_keys(2)
    host.write_layer([a], 0, random_kv(1))
    with pytest.raises(StoreFull):
        host.write_layer([b], 0, random_kv(1))
    clock.now_s = 10.0
    evicted = host.write_layer([b], 0, random_kv(1)).evicted
    assert evicted[0].key == a and evicted[0].data is None


def test_write_never_evicts_blocks_of_its_own_batch() -> None:
    host = tier(2)
    a, b, c = make_keys(3)
    put_blocks(host, [a])
    put_blocks(host, [b])
    host.read_layer([b], 0)
    evicted = host.write_layer([a, c], 0, random_kv(2)).evicted
    assert [block.key for block in evicted] == [b]


def test_usage_reports_blocks_bytes_and_leases() -> None:
    host = tier(4)
    keys = make_keys(2)
    put_blocks(host, keys)
    host.write_layer(make_keys(1), 0, random_kv(1))
    host.lease(keys[:1], ttl_s=60)
    usage = host.usage()
    assert (usage.capacity_blocks, usage.used_blocks, usage.complete_blocks) == (4, 3, 2)
    assert usage.leased_blocks == 2
    assert usage.used_bytes == 3 * LAYOUT.block_bytes


def test_rejects_wrong_shape_layer_and_tiny_capacity() -> None:
    host = tier(2)
    with pytest.raises(LayoutMismatch):
        host.write_layer(make_keys(2), 0, random_kv(1))
    with pytest.raises(ValueError, match="layer 3 out of range"):
        host.write_layer(make_keys(1), 3, random_kv(1))
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(LAYOUT, LAYOUT.block_bytes - 1)


def test_a_producer_writes_claimed_slots_through_the_shared_arena() -> None:
    from halfmoon.kvstore.shared_arena import ArenaInfo, MappedArena

    host, keys = tier(4, shared=True), make_keys(3)
    assert host.arena_path is not None
    producer = MappedArena(ArenaInfo(host.arena_path, "node", host.num_slots, LAYOUT))
    slots, lease_id, _ = host.claim(keys, ttl_s=60.0)
    payloads = [random_kv(3, seed) for seed in range(LAYOUT.num_layers)]
    for layer, kv in enumerate(payloads):
        assert keys[0] not in host
        producer.write(slots, layer, kv)
        completed = host.written(keys, layer, slots).completed
        assert completed == (keys if layer == LAYOUT.num_layers - 1 else [])
    for layer, kv in enumerate(payloads):
        assert_same(host.read_layer(keys, layer), kv)
    assert host.usage().leased_blocks == 3  # the claim's lease, until its producer releases it
    assert host.release(lease_id)
    assert host.usage().leased_blocks == 0


def test_claimed_slots_are_not_evicted_and_a_stale_claims_notice_is_ignored() -> None:
    clock = FakeClock()
    host = tier(2, pending_ttl_s=5.0, clock=clock)
    first, second = make_keys(2), make_keys(2)
    slots, _, _ = host.claim(first, ttl_s=5.0)
    with pytest.raises(StoreFull):
        host.claim(second, ttl_s=5.0)  # both slots are claimed: nothing to evict
    clock.now_s = 10.0  # the claim and its pending leases expired: the slots go to others
    taken, _, result = host.claim(second, ttl_s=5.0)
    assert sorted(b.key for b in result.evicted) == sorted(first)
    assert host.written(first, 0, slots).completed == []  # the old producer's notice is ignored
    assert not host.has_layer(first[0], 0) and sorted(taken) == sorted(slots)
