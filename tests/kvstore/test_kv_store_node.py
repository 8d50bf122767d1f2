from __future__ import annotations

import time
import uuid

import pytest
import ray
from kv_helpers import LAYOUT, assert_same, make_keys, random_kv

from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.errors import LayerTimeout
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.shared_arena import map_arena
from halfmoon.kvstore.store_node import start_store_node


@pytest.fixture
def node(ray_session, redis_url: str):
    config = StoreConfig(host_capacity_bytes=64 * LAYOUT.block_bytes, redis_url=redis_url)
    actor = start_store_node(LAYOUT, config, name=f"kvstore-test-{uuid.uuid4().hex[:8]}")
    yield actor
    ray.get(actor.close.remote())
    ray.kill(actor)


# The actors take payloads as arguments: workers cannot import this test folder's helpers.
@ray.remote(num_cpus=0)
class Writer:
    def put_all(self, node, keys: list[bytes], layers: list[LayerKV]) -> None:
        for layer, kv in enumerate(layers):
            ray.get(node.put_layer.remote(keys, layer, kv))


@ray.remote(num_cpus=0)
class Reader:
    def get_all(self, node, keys: list[bytes], num_layers: int) -> list[LayerKV]:
        return ray.get([node.get_layer.remote(keys, layer, 30.0) for layer in range(num_layers)])


def test_round_trip_through_the_actor_is_bit_exact(node) -> None:
    keys, kv = make_keys(4), random_kv(4, 9)
    ray.get(node.put_layer.remote(keys, 0, kv))
    assert_same(ray.get(node.get_layer.remote(keys, 0, 0.0)), kv)


def test_timeout_crosses_the_actor_boundary_as_layer_timeout(node) -> None:
    with pytest.raises(LayerTimeout, match="layer 1"):
        ray.get(node.get_layer.remote(make_keys(1), 1, 0.01))


def test_concurrent_writers_and_readers_on_the_same_keys(node) -> None:
    keys = make_keys(6)
    readers = [Reader.remote() for _ in range(3)]
    reads = [reader.get_all.remote(node, keys, LAYOUT.num_layers) for reader in readers]
    writers = [Writer.remote() for _ in range(3)]
    layers = [random_kv(6, 100 + layer) for layer in range(LAYOUT.num_layers)]
    ray.get([writer.put_all.remote(node, keys, layers) for writer in writers])
    for layers in ray.get(reads):
        for layer, kv in enumerate(layers):
            assert_same(kv, random_kv(6, 100 + layer))
    stats = ray.get(node.stats.remote())
    assert stats.host.blocks == 6 and stats.host.leased_blocks == 0
    for actor in readers + writers:
        ray.kill(actor)


def test_a_stream_crosses_the_actor_and_a_cancel_ends_it(node) -> None:
    first, second = make_keys(2), make_keys(3)
    stream = node.stream_layers.options(num_returns="streaming").remote(
        [first, second], LAYOUT.num_layers, 30.0
    )
    for layer in range(LAYOUT.num_layers):
        ray.get(node.put_layer.remote(first, layer, random_kv(2, layer)))
    for layer in range(LAYOUT.num_layers):
        assert_same(ray.get(next(stream)), random_kv(2, layer))
    ray.cancel(stream)  # the second unit is never put: the store stops waiting for it
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(next(stream))
    assert ray.get(node.stats.remote()).host.leased_blocks == 0


@pytest.mark.timeout(120)
def test_reads_waiting_in_the_node_never_hold_back_a_put(node) -> None:
    # Each waiting read holds one of the actor's call slots. With Ray's default of 1,000 for
    # async actors, the put below waited until these reads timed out (they wait for it).
    keys = make_keys(1)
    waiting = [node.get_layer.remote(keys, 0, 60.0) for _ in range(1_100)]
    ray.get(node.stats.remote())  # the calls before this one have started
    ray.get(node.put_layer.remote(keys, 0, random_kv(1, 5)), timeout=30)
    for kv in ray.get(waiting, timeout=30):
        assert_same(kv, random_kv(1, 5))


def test_a_producer_on_the_node_writes_through_the_shared_arena(node) -> None:
    info = ray.get(node.arena_info.remote())
    arena = map_arena(info, ray.get_runtime_context().get_node_id())
    assert arena is not None
    assert map_arena(info, "another-node") is None  # only producers on its node map it
    keys = make_keys(3)
    payloads = [random_kv(3, seed) for seed in range(LAYOUT.num_layers)]
    reading = node.stream_layers.options(num_returns="streaming").remote([keys], LAYOUT.num_layers)
    slots_read = node.stream_slots.options(num_returns="streaming").remote(
        [keys], LAYOUT.num_layers, None, "reader"
    )
    slots, lease_id = ray.get(node.claim.remote(keys))
    for layer, kv in enumerate(payloads):
        arena.write(slots, layer, kv)
        last = layer == LAYOUT.num_layers - 1
        ray.get(node.layer_written.remote(keys, layer, slots, lease_id if last else None))
    for kv, ref in zip(payloads, reading, strict=True):
        assert_same(ray.get(ref), kv)
    for layer, (kv, ref) in enumerate(zip(payloads, slots_read, strict=True)):
        where, _ = ray.get(ref)  # a reader on the node copies the layer out itself
        assert_same(arena.read(where, layer), kv)
    assert ray.get(node.cached_prefix.remote(keys)) == 3
    assert ray.get(node.stats.remote()).host.leased_blocks == 3  # until the reader ends it
    ray.get(node.end_stream.remote("reader"))
    assert ray.get(node.stats.remote()).host.leased_blocks == 0


def test_a_units_layers_are_told_in_one_call(node) -> None:
    """With direct notices the producer tells the store of a unit once, after its last layer:
    every layer is present then (a reader waiting for one wakes), and the claim is released."""
    arena = map_arena(ray.get(node.arena_info.remote()), ray.get_runtime_context().get_node_id())
    keys = make_keys(2)
    payloads = [random_kv(2, 10 + seed) for seed in range(LAYOUT.num_layers)]
    waiting = node.get_layer.remote(keys, 0, 60.0)
    slots, lease_id = ray.get(node.claim.remote(keys))
    for layer, kv in enumerate(payloads):
        arena.write(slots, layer, kv)
    assert ray.get(node.cached_prefix.remote(keys)) == 0  # not told yet
    ray.get(node.layer_written.remote(keys, list(range(LAYOUT.num_layers)), slots, lease_id))
    assert_same(ray.get(waiting, timeout=30), payloads[0])
    assert ray.get(node.cached_prefix.remote(keys)) == 2
    for layer, kv in enumerate(payloads):
        assert_same(ray.get(node.get_layer.remote(keys, layer)), kv)
    assert ray.get(node.stats.remote()).host.leased_blocks == 0


def test_a_cancelled_slot_stream_leaves_no_lease_behind(node) -> None:
    """A reader that stops early (its request was aborted) ends its stream: the leases of
    the items the store sent ahead of it, never taken, go too."""
    keys = make_keys(2)
    for layer in range(LAYOUT.num_layers):
        ray.get(node.put_layer.remote(keys, layer, random_kv(2, layer)))
    stream = node.stream_slots.options(num_returns="streaming").remote(
        [keys], LAYOUT.num_layers, None, "aborted"
    )
    ray.get(next(stream))  # the reader takes one layer, then its request is aborted
    ray.cancel(stream)
    ray.get(node.end_stream.remote("aborted"))
    deadline = time.monotonic() + 10
    while ray.get(node.stats.remote()).host.leased_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(node.stats.remote()).host.leased_blocks == 0


def test_a_stored_prefix_is_leased_by_its_slots_only_when_every_layer_is_there(node) -> None:
    """A prefill worker on the store's node copies a stored prefix out of the arena itself:
    `lease_slots` gives the slots and holds them, or None when some layer is missing (then
    `get_layer` reads it, from Redis if need be)."""
    arena = map_arena(ray.get(node.arena_info.remote()), ray.get_runtime_context().get_node_id())
    keys = make_keys(3)
    payloads = [random_kv(3, 40 + layer) for layer in range(LAYOUT.num_layers)]
    for layer, kv in enumerate(payloads[:-1]):
        ray.get(node.put_layer.remote(keys, layer, kv))
    assert ray.get(node.lease_slots.remote(keys)) is None  # its last layer is not there yet
    ray.get(node.put_layer.remote(keys, LAYOUT.num_layers - 1, payloads[-1]))
    slots, lease_id = ray.get(node.lease_slots.remote(keys))
    assert ray.get(node.stats.remote()).host.leased_blocks == 3
    for layer, kv in enumerate(payloads):
        assert_same(arena.read(slots, layer), kv)
    assert ray.get(node.release.remote(lease_id))
    assert ray.get(node.stats.remote()).host.leased_blocks == 0
