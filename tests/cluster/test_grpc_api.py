"""The gRPC API over a real LocalBackend: exact greedy outputs, streaming, validation, cancel."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from halfmoon.cluster.client.grpc_client import AsyncClient, Client, ServerError
from halfmoon.cluster.serving.backend import Usage
from halfmoon.engine import SamplingParams

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived a tiny model.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "héllo wörld",
]
LONG = dict(max_tokens=1900, ignore_eos=True)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_concurrent_greedy_requests_equal_the_offline_engine(client, tiny_llm):
    expected = tiny_llm.generate(PROMPTS, greedy(12))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(
            pool.map(lambda p: client.complete(p, max_tokens=12, temperature=0.0), PROMPTS)
        )
    for result, want in zip(results, expected, strict=True):
        assert result.token_ids == want.token_ids
        assert result.text == want.text
        assert result.finish_reason == want.finish_reason
        assert result.usage == Usage(want.num_prompt_tokens, len(want.token_ids), 0)


def test_streamed_deltas_concatenate_to_the_full_text(client, tiny_llm):
    prompt = "streamed, one token at a time"
    want = tiny_llm.generate(prompt, greedy(20))[0]
    deltas = list(client.generate(prompt, max_tokens=20, temperature=0.0))
    assert len(deltas) == 20
    assert "".join(d.text for d in deltas) == want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert [d.finish_reason for d in deltas] == [None] * 19 + ["length"]
    assert [d.usage for d in deltas[:-1]] == [None] * 19
    assert deltas[-1].usage == Usage(want.num_prompt_tokens, 20, 0)


def test_usage_counts_cached_prompt_tokens(client):
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can come from the cache
    first = client.complete(prompt, max_tokens=2)
    second = client.complete(prompt, max_tokens=2)
    assert (first.usage, second.usage) == (Usage(40, 2, 0), Usage(40, 2, 32))


def test_chat_and_token_id_inputs_equal_the_offline_engine(client, tiny_llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    token_ids = tiny_llm.tokenizer.encode("Hello there")
    want_chat, want_ids = tiny_llm.generate([messages, token_ids], greedy(10))
    chat = client.complete(messages, max_tokens=10, temperature=0.0)
    ids = client.complete(token_ids, max_tokens=10, temperature=0.0)
    assert (chat.token_ids, chat.text) == (want_chat.token_ids, want_chat.text)
    assert (ids.token_ids, ids.text) == (want_ids.token_ids, want_ids.text)
    assert chat.usage.prompt_tokens == want_chat.num_prompt_tokens


def test_fifty_concurrent_streams_all_complete(server):
    async def run() -> list:
        async with AsyncClient(server.address) as client:
            prompts = [f"request number {i}" for i in range(50)]
            return await asyncio.gather(
                *(client.complete(p, max_tokens=8, ignore_eos=True) for p in prompts)
            )

    results = asyncio.run(run())
    assert [len(r.token_ids) for r in results] == [8] * 50
    assert {r.finish_reason for r in results} == {"length"}
    assert server.wait_until_idle()


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ("", {}, "text"),
        ("hi", {"top_p": 2.0}, "top_p"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ([5, -1], {}, "token_ids"),
        ("hi", {"temperature": math.nan}, "temperature"),
        ("hi", {"stop": [""]}, "stop"),
        ("hi", {"seed": -3}, "seed"),
        ([1, 99999], {}, "prompt_token_ids"),
        ([{"role": "", "content": "x"}], {}, "chat.messages[0].role"),
    ],
)
def test_bad_request_gets_invalid_argument_naming_the_field(client, prompt, sampling, field):
    with pytest.raises(ServerError) as caught:
        client.complete(prompt, **sampling)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.message.startswith(f"{field}=")
    assert client.complete("still serving", max_tokens=2, ignore_eos=True).finish_reason == "length"


def test_bad_slo_override_gets_invalid_argument(client):
    with pytest.raises(ServerError) as caught:
        client.complete("hi", ttft_slo_s=-1.0)
    assert (caught.value.code, caught.value.message) == (
        "INVALID_ARGUMENT",
        "ttft_slo_s=-1.0 is invalid: must be a finite number of seconds > 0",
    )


def test_client_cancel_mid_stream_releases_every_page(client, server):
    generated = server.num_generated_tokens()
    stream = client.generate("cancel me", **LONG)
    next(stream)
    assert server.num_used_pages() > 0
    stream.cancel()
    with pytest.raises(ServerError) as caught:
        list(stream)
    assert caught.value.code == "CANCELLED"
    assert server.wait_until_idle()
    assert server.num_generated_tokens() - generated < LONG["max_tokens"]


def test_async_client_cancel_releases_every_page(server):
    async def run() -> str:
        async with AsyncClient(server.address) as client:
            stream = client.generate("cancel me too", **LONG)
            await anext(stream)
            stream.cancel()
            with pytest.raises(ServerError) as caught:
                await anext(stream)
            return caught.value.code

    assert asyncio.run(run()) == "CANCELLED"
    assert server.wait_until_idle()


def test_expired_deadline_releases_every_page(client, server):
    generated = server.num_generated_tokens()
    with pytest.raises(ServerError) as caught:
        client.complete("too slow", timeout=0.3, **LONG)
    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert server.wait_until_idle()
    assert server.num_generated_tokens() - generated < LONG["max_tokens"]


def test_abort_ends_the_stream_with_finish_reason_abort(client, server):
    stream = client.generate("abort me", **LONG)
    first = next(stream)
    assert client.abort(stream.request_id) is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].usage.completion_tokens == len(first.token_ids) + sum(
        len(d.token_ids) for d in rest
    )
    assert client.abort(stream.request_id) is False
    assert server.wait_until_idle()


def test_model_and_server_info(client, tiny_model_dir):
    info = client.model_info()
    assert (info.model, info.architecture, info.block_size) == (
        str(tiny_model_dir),
        "LlamaForCausalLM",
        16,
    )
    server_info = client.server_info()
    assert (server_info.mode, server_info.model) == ("local", str(tiny_model_dir))
    assert server_info.details["engine"]["num_pages"] == 128


def test_health_reports_serving(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "halfmoon.v1.Halfmoon"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_halfmoon_service(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in reply.list_services_response.service}
    assert {"halfmoon.v1.Halfmoon", "grpc.health.v1.Health"} <= names
