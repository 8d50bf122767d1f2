"""A decode worker receiving from another node on Mooncake's Transfer Engine
(decode_worker/engine_receive.py): it grants a receive staging slots, copies each layer out once
its landed notice came, joins its batch on the first-token notice, refuses and counts notices
that do not match its grant, and holds an aborted receive's slots back. Real decode worker
actor and real engines; this test plays the prefill worker on another node with the writes and
notices it makes (kvstore/transfer/engine.py), from an endpoint of its own."""

from __future__ import annotations

import time
import uuid

import pytest
import ray
import torch
from cluster_kit import wait_until

from halfmoon.cluster.worker.errors import WorkerError
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.keys import block_keys
from halfmoon.kvstore.store_node import start_store_node
from halfmoon.kvstore.transfer.engine import (
    TransferFailed,
    first_token_message,
    landed_message,
    open_endpoint,
)
from halfmoon.kvstore.transfer.plan import plan_transfer

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(3, 60))  # 57 tokens: two units of 32, the last with a partial block
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# On loopback: this Ray instance's node address is the machine's own.
MOONCAKE = TransferSettings(engine="mooncake", host="127.0.0.1", staging_bytes=4 << 20)


@pytest.fixture(scope="module")
def parts(tiny_model_dir, ray_session):
    config = EngineConfig(model=str(tiny_model_dir), num_pages=32, prefill_chunk_size=32)
    local = LLMEngine(config)  # the plan's keys and the KV layout, as the prefill worker has
    # A store by a name of its own: to the decode worker, the store of another node.
    store_name = f"elsewhere-{uuid.uuid4().hex[:8]}"
    store = start_store_node(local.kv_cache.layout, name=store_name)
    decode = (
        ray.remote(DecodeWorker)
        .options(name=f"engine-decode-{uuid.uuid4().hex[:8]}", max_concurrency=100)
        .remote("decode-0", config, store, 30.0, 60.0, 2.0, transfer=MOONCAKE)
    )
    peer = ray.get(decode.kv_peer.remote())
    writer, path = open_endpoint(MOONCAKE)
    assert writer is not None, path
    yield local, store_name, decode, peer, writer
    writer.close()
    ray.kill(decode)
    ray.kill(store)


def start(parts, request_id: str):
    """The router's reserve (the prefill worker was given the decode worker's peer), then the
    prefill worker's ask for a grant."""
    local, store_name, decode, _, _ = parts
    facts = local.facts
    keys = block_keys(facts.root_key, PROMPT, facts.block_size)
    ticket = uuid.uuid4().hex
    task = DecodeTask(request_id, PROMPT, PARAMS, keys, ticket=ticket, direct=True)
    task.store_name = store_name
    assert ray.get(decode.reserve.remote(task)) == 4
    grant = ray.get(decode.kv_grant.remote(ticket, True))
    units = plan_transfer(facts.root_key, keys, PROMPT, facts.block_size, 32, request_id)
    return ticket, grant, units


def write_layer(parts, ticket, grant, unit, index: int, layer: int, token=None) -> None:
    layout = parts[0].kv_cache.layout
    shape = (len(unit.keys), *layout.page_shape)
    k, v = (torch.randn(shape).to(layout.dtype) for _ in "kv")
    k_at, v_at = grant.places(layer, unit.first_block)
    message = landed_message(token or grant.token, index, layer)
    parts[4].write(
        grant.session,
        [(k.data_ptr(), k_at, k.nbytes), (v.data_ptr(), v_at, v.nbytes)],
        notify=(ticket, message),
    )


def counters(decode) -> dict:
    return ray.get(decode.counters.remote())


def test_the_decode_worker_advertises_its_engine_and_grants_a_run_of_slots(parts):
    local, _, decode, peer, _ = parts
    assert peer.engine is not None and peer.engine.session.startswith("127.0.0.1:")
    ticket, grant, units = start(parts, "engine-grant")
    assert grant.num_blocks == 4 and grant.session == peer.engine.session
    assert counters(decode)["kv_transfer_path"] == "mooncake tcp"
    ray.get(decode.abort.remote("engine-grant", ticket))


def test_layers_written_on_the_engine_land_and_the_first_token_notice_joins_early(parts):
    local, _, decode, _, writer = parts
    before = counters(decode)
    ticket, grant, units = start(parts, "engine-receive")
    for index, unit in enumerate(units):
        for layer in range(local.kv_cache.num_layers):
            write_layer(parts, ticket, grant, unit, index, layer)
    writer.notify(grant.session, grant.base, ticket, first_token_message(grant.token, 7))
    wait_until(lambda: counters(decode)["num_early_joins"] > before["num_early_joins"])
    stream = decode.generate.options(num_returns="streaming").remote(ticket, 7)
    outputs = [ray.get(ref) for ref in stream]
    # The first output repeats the first token; then the rest of max_tokens.
    assert not any(isinstance(out, WorkerError) for out in outputs)
    assert len(outputs) == PARAMS.max_tokens
    after = counters(decode)
    assert after["num_engine_receives"] == before["num_engine_receives"] + 1
    landed = after["num_landed_notices"] - before["num_landed_notices"]
    assert landed == len(units) * local.kv_cache.num_layers
    timings = ray.get(decode.receive_timings.remote(ticket))
    assert timings.num_bytes == 4 * local.kv_cache.layout.block_bytes


def test_notices_that_do_not_match_the_grant_are_refused_and_counted(parts):
    local, _, decode, _, writer = parts
    before = counters(decode)["num_refused_landed_notices"]
    ticket, grant, units = start(parts, "engine-forged")
    write_layer(parts, ticket, grant, units[0], 0, 0, token="0" * 16)  # a stale grant's token
    writer.notify(grant.session, grant.base, ticket, landed_message(grant.token, 0, 999))
    writer.notify(grant.session, grant.base, ticket, "not a notice")
    wait_until(lambda: counters(decode)["num_refused_landed_notices"] == before + 3)
    ray.get(decode.abort.remote("engine-forged", ticket))


def test_a_write_outside_the_registered_staging_is_refused_by_the_peer(parts):
    writer = parts[4]
    ticket, grant, units = start(parts, "engine-outside")
    past = grant.base + grant.num_slots * grant.page_bytes * 2 * parts[0].kv_cache.num_layers
    data = torch.zeros(4096, dtype=torch.uint8)
    failed = writer.counters()["num_failed_engine_writes"]
    with pytest.raises(TransferFailed):
        writer.write(grant.session, [(data.data_ptr(), past + 4096, 4096)])
    assert writer.counters()["num_failed_engine_writes"] == failed + 1
    ray.get(parts[2].abort.remote("engine-outside", ticket))


def test_an_aborted_receive_holds_its_slots_back(parts):
    decode = parts[2]
    ticket, grant, units = start(parts, "engine-abort")
    free = counters(decode)["staging_slots_free"]
    ray.get(decode.abort.remote("engine-abort", ticket))
    time.sleep(0.2)
    # Quarantined (a prefill worker that has not heard may still write into them).
    after = counters(decode)
    assert after["staging_slots_free"] == free
    ticket2, grant2, _ = start(parts, "engine-after-abort")
    assert grant2.first_slot != grant.first_slot
    ray.get(decode.abort.remote("engine-after-abort", ticket2))


def test_without_the_engine_a_worker_says_why(ray_session):
    endpoint, path = open_endpoint(TransferSettings(engine="ray"))
    assert endpoint is None and path == "ray (store.transfer.engine: ray)"
    endpoint, path = open_endpoint(TransferSettings())  # auto: this Ray is on one machine
    assert endpoint is None and "on one machine" in path
