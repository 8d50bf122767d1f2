"""A decode worker's reads wait for a prefill however long it queues, and time out only once
the prefill has returned; a reservation nobody hands over is freed (real decode worker and
store node actors, the tiny model)."""

from __future__ import annotations

import asyncio
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
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.store_node import start_store_node
from halfmoon.kvstore.transfer.plan import plan_transfer

GET_TIMEOUT_S = 0.5
HANDOFF_TIMEOUT_S = 5.0
PROMPT = list(range(3, 60))  # 57 tokens: two units of 32, the last with a partial block


@pytest.fixture(scope="module")
def parts(tiny_model_dir, ray_session):
    config = EngineConfig(model=str(tiny_model_dir), num_pages=32, prefill_chunk_size=32)
    local = LLMEngine(config)  # the plan's keys and the KV layout, as the prefill worker has
    layout = local.kv_cache.layout
    store = start_store_node(layout, name=f"receive-test-{uuid.uuid4().hex[:8]}")
    decode = (
        ray.remote(DecodeWorker)
        .options(max_concurrency=100)
        .remote("decode-0", config, store, GET_TIMEOUT_S, HANDOFF_TIMEOUT_S)
    )
    yield local.facts, layout, store, decode
    ray.kill(decode)
    ray.kill(store)


def reserve(parts, request_id: str, params: SamplingParams) -> tuple[int, list]:
    """Reserve PROMPT on the decode worker: how many pages it reserved, and the prefill's units."""
    facts, _, _, decode = parts
    keys = block_keys(facts.root_key, PROMPT, facts.block_size)
    units = plan_transfer(facts.root_key, keys, PROMPT, facts.block_size, 32, request_id)
    num_pages = ray.get(decode.reserve.remote(DecodeTask(request_id, PROMPT, params, keys)))
    return num_pages, units


def put_layers(store, units, layout: KvLayout, skip_last: bool = False) -> None:
    for unit in units:
        for layer in range(layout.num_layers):
            if skip_last and unit is units[-1] and layer == layout.num_layers - 1:
                continue
            zeros = torch.zeros(len(unit.keys), *layout.page_shape, dtype=layout.dtype)
            ray.get(store.put_layer.remote(unit.keys, layer, LayerKV(zeros, zeros.clone())))


def outputs(decode, request_id: str) -> list:
    async def collect():
        stream = decode.generate.options(num_returns="streaming").remote(request_id, 7)
        return [await ref async for ref in stream]

    return asyncio.run(collect())


@pytest.mark.timeout(120)
def test_reads_wait_for_a_prefill_that_starts_after_the_read_timeout(parts):
    _, layout, store, decode = parts
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    num_pages, units = reserve(parts, "late", params)
    assert num_pages == 4
    asyncio.run(asyncio.sleep(4 * GET_TIMEOUT_S))  # the prefill queues behind others
    put_layers(store, units, layout)
    got = outputs(decode, "late")
    assert not any(isinstance(out, WorkerError) for out in got), got
    tokens = [token for out in got for token in out.new_token_ids]
    assert got[-1].finished and tokens[0] == 7 and len(tokens) == 3  # 7: the prefill's token


@pytest.mark.timeout(120)
def test_a_layer_still_missing_after_the_hand_off_fails_within_the_timeout(parts):
    _, layout, store, decode = parts
    _, units = reserve(parts, "lost", SamplingParams(max_tokens=3, temperature=0.0))
    put_layers(store, units, layout, skip_last=True)
    (error,) = outputs(decode, "lost")
    assert isinstance(error, WorkerError) and error.code == "UNAVAILABLE"
    assert "store.get_timeout_s" in error.message
    assert error.retryable  # nothing was decoded: the router may run it elsewhere
    counters = ray.get(decode.counters.remote())
    assert counters["num_used_pages"] == 0 and counters["num_receiving"] == 0


@pytest.mark.timeout(120)
def test_a_reservation_never_handed_over_is_freed(parts):
    """The router died between the reserve and the hand-off: the pages come back."""
    _, layout, store, decode = parts
    expired = ray.get(decode.counters.remote())["num_expired_reservations"]
    num_pages, units = reserve(parts, "orphan", SamplingParams(max_tokens=3, temperature=0.0))
    assert num_pages == 4
    put_layers(store, units, layout)
    counters = ray.get(decode.counters.remote())
    assert counters["num_used_pages"] == 4  # held while the hand-off may still come
    for _ in range(200):
        counters = ray.get(decode.counters.remote())
        if counters["num_used_pages"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert counters["num_used_pages"] == 0 and counters["num_receiving"] == 0
    assert counters["num_expired_reservations"] == expired + 1
    (error,) = outputs(decode, "orphan")  # a hand-off after the expiry says why
    assert isinstance(error, WorkerError) and error.code == "UNAVAILABLE"
    assert "was freed" in error.message and error.retryable
