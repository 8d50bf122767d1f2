"""A decode worker told of each layer and of the first token by the prefill worker itself
(kvstore/transfer/channel.py): it copies the layers out of the store's shared arena, joins its batch
before the router's hand-off, and gives every claim back to the store, also when the receive
is aborted, fails, or its reserve never comes. Real decode worker and store node actors; this
test plays the prefill worker with the same calls it makes (claim, arena copy, notices)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import ray
import torch

from halfmoon.cluster.worker.errors import WorkerError
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.kvstore.keys import block_keys
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.shared_arena import map_arena
from halfmoon.kvstore.store_node import start_store_node
from halfmoon.kvstore.transfer.channel import NoticeSender
from halfmoon.kvstore.transfer.notice_format import (
    LayerNotice,
    PagesNotice,
    ReleaseNotice,
    TokenNotice,
)
from halfmoon.kvstore.transfer.plan import plan_transfer

PROMPT = list(range(3, 60))  # 57 tokens: two units of 32, the last with a partial block
EARLY_NOTICE_S = 2.0


@pytest.fixture(scope="module")
def parts(tiny_model_dir, ray_session):
    config = EngineConfig(model=str(tiny_model_dir), num_pages=32, prefill_chunk_size=32)
    local = LLMEngine(config)  # the plan's keys and the KV layout, as the prefill worker has
    layout = local.kv_cache.layout
    store = start_store_node(layout, name=f"notice-test-{uuid.uuid4().hex[:8]}")
    decode = (
        ray.remote(DecodeWorker)
        .options(max_concurrency=100)
        # KV gets wait up to 30 s (serving's default): the lending tests open a cache under a
        # loaded make test, where 5 s once ran out (a WorkerError instead of tokens)
        .remote("decode-0", config, store, 30.0, 60.0, EARLY_NOTICE_S)
    )
    peer = ray.get(decode.kv_peer.remote())
    arena = map_arena(ray.get(store.arena_info.remote()), ray.get_runtime_context().get_node_id())
    assert arena is not None
    sender = NoticeSender()
    yield local.facts, layout, store, decode, peer, arena, sender
    sender.close()
    ray.kill(decode)
    ray.kill(store)


class Prefill:
    """What the prefill worker does for one request, a unit and a layer at a time."""

    def __init__(self, parts, key: str, request_id: str):
        facts, self.layout, self.store, _, self.peer, self.arena, self.sender = parts
        self.key = key
        keys = prompt_keys(facts)
        self.units = plan_transfer(facts.root_key, keys, PROMPT, facts.block_size, 32, request_id)
        self.claims = {}

    def publish(self, unit_index: int, layers=None, slots_of=None) -> None:
        unit = self.units[unit_index]
        if unit_index not in self.claims:  # once per unit, with its first layer
            self.claims[unit_index] = ray.get(self.store.claim.remote(unit.keys))
        slots, lease = self.claims[unit_index]
        last = self.layout.num_layers - 1
        for layer in range(self.layout.num_layers) if layers is None else layers:
            shape = (len(unit.keys), *self.layout.page_shape)
            kv = LayerKV(*(torch.randn(shape).to(self.layout.dtype) for _ in "kv"))
            self.arena.write(slots, layer, kv)
            ray.get(self.store.layer_written.remote(unit.keys, layer, slots, None))
            named = tuple(slots) if slots_of is None else slots_of(slots)
            notice = LayerNotice(self.key, unit_index, layer, lease if layer == last else 0, named)
            self.sender.send(self.peer, notice)

    def first_token(self, token_id: int) -> None:
        self.sender.send(self.peer, TokenNotice(self.key, token_id))


def prompt_keys(facts) -> list[bytes]:
    """The prompt's full-block keys, as the router hashes them once."""
    return block_keys(facts.root_key, PROMPT, facts.block_size)


def reserve(parts, request_id: str, ticket: str, first_token_id: int | None = None):
    """The router's reserve of PROMPT, told directly by the prefill worker."""
    facts, decode = parts[0], parts[3]
    keys = prompt_keys(facts)
    task = DecodeTask(
        request_id, PROMPT, PARAMS, keys, ticket=ticket, direct=True, first_token_id=first_token_id
    )
    return decode.reserve.remote(task)


def counters(decode) -> dict:
    return ray.get(decode.counters.remote())


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def leased(store) -> int:
    return ray.get(store.stats.remote()).host.leased_blocks


def outputs(decode, ticket: str, first_token_id: int) -> list:
    async def collect():
        stream = decode.generate.options(num_returns="streaming").remote(ticket, first_token_id)
        return [await ref async for ref in stream]

    return asyncio.run(collect())


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.timeout(120)
def test_a_notified_request_joins_before_the_hand_off_and_returns_every_claim(parts):
    _, _, store, decode, *_ = parts
    before = counters(decode)
    assert ray.get(reserve(parts, "n1", "t1")) == 4
    prefill = Prefill(parts, "t1", "n1")
    prefill.publish(0)
    prefill.publish(1)
    prefill.first_token(9)
    joined = before["num_early_joins"]
    after = wait_for(lambda: (c := counters(decode))["num_early_joins"] > joined and c)
    assert after["num_direct_receives"] == before["num_direct_receives"] + 1
    assert after["num_shared_reads"] - before["num_shared_reads"] == 2 * prefill.layout.num_layers
    handed_over_at = time.time()
    got = outputs(decode, "t1", 9)
    timings = ray.get(decode.receive_timings.remote("t1"))
    assert timings.joined_at < handed_over_at  # decoding began before the hand-off
    tokens = [token for out in got for token in out.new_token_ids]
    assert tokens[0] == 9 and len(tokens) == 4 and got[-1].finished
    wait_for(lambda: leased(store) == 0)  # each unit's claim released once copied


@pytest.mark.timeout(120)
def test_notices_that_overtake_the_reserve_wait_for_it(parts):
    decode = parts[3]
    prefill = Prefill(parts, "t2", "n2")
    heard = counters(decode)["num_notices"]
    prefill.publish(0)  # the reserve was sent at the same time, and lands after these
    prefill.publish(1)
    prefill.first_token(11)
    wait_for(lambda: counters(decode)["num_notices"] >= heard + 3)
    ray.get(reserve(parts, "n2", "t2"))
    got = outputs(decode, "t2", 11)
    assert [t for out in got for t in out.new_token_ids][0] == 11 and got[-1].finished


@pytest.mark.timeout(120)
def test_a_retry_with_its_first_token_known_joins_once_the_kv_is_in(parts):
    decode = parts[3]
    joins = counters(decode)["num_early_joins"]
    ray.get(reserve(parts, "n3", "t3", 13))
    prefill = Prefill(parts, "t3", "n3")
    prefill.publish(0)
    prefill.publish(1)
    prefill.first_token(99)  # the retry's own prefill sampled another token: ignored
    wait_for(lambda: counters(decode)["num_early_joins"] > joins)
    got = outputs(decode, "t3", 13)
    assert [t for out in got for t in out.new_token_ids][0] == 13


@pytest.mark.timeout(120)
def test_an_abort_mid_transfer_gives_back_the_claims_of_notices_before_and_after_it(parts):
    _, _, store, decode, *_ = parts
    ray.get(reserve(parts, "n4", "t4"))
    prefill = Prefill(parts, "t4", "n4")
    prefill.publish(0)
    prefill.publish(1, layers=[0])  # the receive waits for unit 1's other layers
    assert ray.get(decode.abort.remote("n4", "t4"))
    prefill.publish(1, layers=range(1, prefill.layout.num_layers))  # late: released at once
    wait_for(lambda: leased(store) == 0)
    c = wait_for(lambda: (c := counters(decode))["num_receiving"] == 0 and c)
    assert c["num_used_pages"] == 0


@pytest.mark.timeout(120)
def test_a_notice_naming_the_wrong_slots_fails_the_receive_retryably(parts):
    _, _, store, decode, *_ = parts
    ray.get(reserve(parts, "n5", "t5"))
    prefill = Prefill(parts, "t5", "n5")
    prefill.publish(0, slots_of=lambda slots: tuple(slots[:1]))  # one slot for two blocks
    (error,) = outputs(decode, "t5", 1)
    assert isinstance(error, WorkerError) and error.code == "UNAVAILABLE" and error.retryable
    assert "names 1 slots" in error.message
    wait_for(lambda: leased(store) == 0)
    assert counters(decode)["num_used_pages"] == 0


@pytest.mark.timeout(120)
def test_an_abort_that_overtakes_the_reserve_refuses_it_and_gives_back_its_notices(parts):
    _, _, store, decode, *_ = parts
    prefill = Prefill(parts, "t7", "n7")
    heard = counters(decode)["num_notices"]
    prefill.publish(0)
    wait_for(lambda: counters(decode)["num_notices"] >= heard + prefill.layout.num_layers)
    assert not ray.get(decode.abort.remote("n7", "t7"))  # nothing reserved to free
    prefill.publish(1)  # after the abort: given back as those of an ended receive
    refused = ray.get(reserve(parts, "n7", "t7"))
    assert isinstance(refused, WorkerError) and refused.code == "CANCELLED"
    wait_for(lambda: leased(store) == 0)
    assert counters(decode)["num_used_pages"] == 0


@pytest.mark.timeout(120)
def test_notices_whose_reserve_never_comes_give_their_claims_back(parts):
    store = parts[2]
    prefill = Prefill(parts, "t6", "n6")  # the reserve failed, or the router died
    prefill.publish(0)
    assert leased(store) > 0
    wait_for(lambda: leased(store) == 0, timeout_s=EARLY_NOTICE_S + 10)


# The device tier: the prefill worker lends its own pages (engine/kv_cache.py). Here the test
# process holds the lending engine's shared KV cache, and a named actor stands for the prefill
# worker's actor, which the decode worker asks for the cache's export.


@ray.remote
class Lender:
    def __init__(self, export):
        self.export = export

    def kv_export(self):
        return self.export


class SeededPrefill(Prefill):
    """A prefill whose arena copy of each layer holds `arena_seed`'s values; with a `lending`
    side it first offers each layer in that engine's own pages, holding `seed`'s values, as the
    prefill worker does."""

    def __init__(self, parts, key: str, arena_seed: int, lending=None, seed: int = 0):
        super().__init__(parts, key, key)
        self.lending, self.seed, self.arena_seed = lending, seed, arena_seed
        if lending is not None:
            self.sender = lending.sender

    def publish(self, unit_index: int, layers=None, slots_of=None) -> None:
        unit = self.units[unit_index]
        if unit_index not in self.claims:
            self.claims[unit_index] = ray.get(self.store.claim.remote(unit.keys))
        slots, lease = self.claims[unit_index]
        pages = tuple(4 * unit_index + block for block in range(len(unit.keys)))
        last = self.layout.num_layers - 1
        for layer in range(self.layout.num_layers) if layers is None else layers:
            if self.lending is not None:
                kv = unit_kv(self, unit_index, layer, self.seed)
                self.lending.kv_cache.write_layer(layer, pages, kv)
                self.sender.send(self.peer, PagesNotice(self.key, unit_index, layer, pages))
            self.arena.write(slots, layer, unit_kv(self, unit_index, layer, self.arena_seed))
            ray.get(self.store.layer_written.remote(unit.keys, layer, slots, None))
            notice = LayerNotice(self.key, unit_index, layer, lease if layer == last else 0, slots)
            self.sender.send(self.peer, notice)


def unit_kv(prefill: Prefill, unit_index: int, layer: int, seed: int) -> LayerKV:
    generator = torch.Generator().manual_seed(seed * 1000 + unit_index * 100 + layer)
    shape = (len(prefill.units[unit_index].keys), *prefill.layout.page_shape)
    return LayerKV(
        *(torch.randn(shape, generator=generator).to(prefill.layout.dtype) for _ in "kv")
    )


class Lending:
    """The lending side: a shared-KV engine, the actor that exports it, and a sender that says
    hello with that actor's name and collects the decode worker's answers."""

    def __init__(self, tiny_model_dir, export_it: bool = True):
        config = EngineConfig(
            model=str(tiny_model_dir), num_pages=32, prefill_chunk_size=32, share_kv=True
        )
        self.engine = LLMEngine(config)
        self.kv_cache = self.engine.kv_cache
        name = f"lender-{uuid.uuid4().hex[:8]}"
        export = self.kv_cache.export() if export_it else None
        self.actor = Lender.options(name=name).remote(export)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.answers = []
        self.sender = NoticeSender(
            name, lambda peer, answer: self.answers.append(answer), self.loop
        )

    def connect(self, decode, peer) -> None:
        """Say hello; wait until the decode worker has opened (or tried to open) the cache."""
        opened, heard = counters(decode)["num_lenders"], counters(decode)["num_notices"]
        self.sender.send(peer, TokenNotice("hello-only", 0))
        if self.kv_cache.export() is not None and ray.get(self.actor.kv_export.remote()):
            wait_for(lambda: counters(decode)["num_lenders"] > opened)
        else:
            wait_for(lambda: counters(decode)["num_notices"] > heard)

    def close(self) -> None:
        self.sender.close()
        ray.kill(self.actor)
        self.loop.call_soon_threadsafe(self.loop.stop)


def decoded(parts, key: str, arena_seed: int, lending=None, seed: int = 0) -> list[int]:
    decode = parts[3]
    ray.get(reserve(parts, key, key))
    prefill = SeededPrefill(parts, key, arena_seed, lending, seed)
    prefill.publish(0)
    prefill.publish(1)
    prefill.first_token(9)
    answers = outputs(decode, key, 9)
    errors = [out for out in answers if isinstance(out, WorkerError)]
    assert not errors, errors
    return [t for out in answers for t in out.new_token_ids]


@pytest.mark.timeout(180)
def test_lent_pages_are_copied_instead_of_the_arena_and_given_back(parts, tiny_model_dir):
    store, decode, peer = parts[2], parts[3], parts[4]
    expected = decoded(parts, "p0", arena_seed=1)  # the arena holding seed 1
    assert decoded(parts, "p1", arena_seed=2) != expected  # the KV matters
    lending = Lending(tiny_model_dir)
    try:
        lending.connect(decode, peer)
        before = counters(decode)
        # the pages hold seed 1, the arena seed 2: the decode worker must take the pages
        assert decoded(parts, "p2", arena_seed=2, lending=lending, seed=1) == expected
        after = counters(decode)
        layers = 2 * lending.kv_cache.num_layers
        assert after["num_page_copies"] - before["num_page_copies"] == layers
        assert after["num_shared_reads"] == before["num_shared_reads"]
        wait_for(lambda: ReleaseNotice("p2") in lending.answers)
        wait_for(lambda: leased(store) == 0)  # the arena's claims went back as well
    finally:
        lending.close()


@pytest.mark.timeout(180)
def test_pages_offered_while_the_cache_is_still_opening_wait_for_it(parts, tiny_model_dir):
    decode = parts[3]
    expected = decoded(parts, "o0", arena_seed=1)
    lending = Lending(tiny_model_dir)  # its hello goes with the first notice, unanswered yet
    try:
        before = counters(decode)
        assert decoded(parts, "o1", arena_seed=2, lending=lending, seed=1) == expected
        after = counters(decode)
        assert after["num_lenders"] == before["num_lenders"] + 1
        layers = 2 * lending.kv_cache.num_layers  # every layer of both units
        assert after["num_page_copies"] - before["num_page_copies"] == layers
        wait_for(lambda: ReleaseNotice("o1") in lending.answers)
    finally:
        lending.close()


@pytest.mark.timeout(180)
def test_pages_of_a_cache_that_cannot_be_opened_are_refused_and_the_arena_used(
    parts, tiny_model_dir
):
    store, decode, peer = parts[2], parts[3], parts[4]
    expected = decoded(parts, "q0", arena_seed=2)
    lending = Lending(tiny_model_dir, export_it=False)  # its actor exports nothing
    try:
        lending.connect(decode, peer)
        before = counters(decode)
        assert decoded(parts, "q1", arena_seed=2, lending=lending, seed=1) == expected
        after = counters(decode)
        assert after["num_page_copies"] == before["num_page_copies"]
        assert lending.answers.count(ReleaseNotice("q1")) == 1  # refused once, for all of it
        wait_for(lambda: leased(store) == 0)
    finally:
        lending.close()


@pytest.mark.timeout(180)
def test_a_lender_that_goes_away_mid_transfer_fails_the_receive_retryably(parts, tiny_model_dir):
    store, decode, peer = parts[2], parts[3], parts[4]
    lending = Lending(tiny_model_dir)
    try:
        lending.connect(decode, peer)
        ray.get(reserve(parts, "g1", "g1"))
        prefill = SeededPrefill(parts, "g1", 2, lending, 1)
        prefill.publish(0)  # unit 1 never comes: the lender's connection ends
        wait_for(lambda: counters(decode)["num_page_copies"] > 0)
        lending.sender.close()
        (error,) = outputs(decode, "g1", 1)
        assert isinstance(error, WorkerError) and error.retryable
        assert "lending this request's pages went away" in error.message
        wait_for(lambda: leased(store) == 0)
        assert counters(decode)["num_used_pages"] == 0
    finally:
        lending.close()
