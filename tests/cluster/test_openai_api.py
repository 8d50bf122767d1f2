"""The OpenAI HTTP API of a real running cluster, through the official `openai` client (sync and
async, streamed and not): the same greedy outputs as gRPC and the offline engine, OpenAI error
objects, X-Request-Id, /health, /metrics, and a client disconnect aborting the request."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import openai
import pytest
import ray
from cluster_kit import counters, running_cluster, wait_until

from halfmoon.engine import SamplingParams

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(900)]

MODEL = "tiny"
PROMPTS = ["Hello there", "The quick brown fox", "x" * 150, "q"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
LONG = {"max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """One disaggregated cluster (1 prefill, 1 decode) for the whole module, with SLO admission
    on (a generous TTFT target, so only a request asking for an impossible one is rejected)."""
    settings = {
        "served_model_name": MODEL,
        "router.admission": "early_rejection",
        "slo.ttft_s": 600.0,
    }
    with running_cluster(tiny_model_dir, **settings) as (cluster, client):
        yield cluster, client, f"http://127.0.0.1:{cluster.ports['http_port']}"


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served[2] + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def test_greedy_completions_over_http_equal_grpc_and_the_offline_engine(served, oai, tiny_llm):
    _, client, _ = served
    expected = tiny_llm.generate(PROMPTS, greedy(8))
    for prompt, want in zip(PROMPTS, expected, strict=True):
        http = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        grpc = client.complete(prompt, max_tokens=8, temperature=0.0)
        assert http.choices[0].text == grpc.text == want.text
        assert http.choices[0].finish_reason == grpc.finish_reason == "length"
        assert (http.usage.prompt_tokens, http.usage.completion_tokens) == (
            want.num_prompt_tokens,
            8,
        )
    token_ids = tiny_llm.tokenizer.encode("Hello there")
    by_ids = oai.completions.create(model=MODEL, prompt=token_ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_streamed_completion_concatenates_to_the_offline_text(oai, tiny_llm):
    want = tiny_llm.generate("streamed, one token at a time", greedy(12))[0]
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="streamed, one token at a time",
            max_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_async_streamed_chat_equals_the_offline_chat_and_ends_with_usage(served, tiny_llm):
    want = tiny_llm.generate([MESSAGES], greedy(10))[0]

    async def run() -> list:
        async with openai.AsyncOpenAI(
            base_url=served[2] + "/v1", api_key="unused", max_retries=0
        ) as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_completion_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.num_prompt_tokens, 10)
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_counts_the_prompt_and_the_tokens_so_far_on_a_cluster(served):
    """guidellm's `continuous_usage_stats`: the router's prompt size on every chunk."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "ignore_eos": True}
    streamed = {**body, "stream": True, "stream_options": options}
    with httpx.stream("POST", served[2] + "/v1/completions", json=streamed) as answer:
        data = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    usages = [json.loads(d)["usage"] for d in data[:-1]]
    whole = httpx.post(served[2] + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usages[-1]["prompt_tokens"] == whole["prompt_tokens"]
    assert [u["prompt_tokens"] for u in usages] == [whole["prompt_tokens"]] * len(usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 4


def test_async_chat_logprobs_equal_the_offline_engine(served, tiny_llm):
    want = tiny_llm.generate([MESSAGES], greedy(6, logprobs=2))[0]

    async def run():
        async with openai.AsyncOpenAI(
            base_url=served[2] + "/v1", api_key="unused", max_retries=0
        ) as client:
            return await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )

    response = asyncio.run(run())
    choice = response.choices[0]
    assert choice.message.content == want.text
    content = choice.logprobs.content
    decode = tiny_llm.tokenizer.decode
    assert [c.token for c in content] == [decode([lp.token_id]) for lp in want.logprobs]
    for got, lp in zip(content, want.logprobs, strict=True):
        assert got.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [decode([t]) for t, _ in lp.top]


def test_completion_logprobs_count_top_tokens_and_text_offsets(oai, tiny_llm):
    want = tiny_llm.generate("Hello there", greedy(5, logprobs=3))[0]
    response = oai.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    lengths = [len(token) for token in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def test_penalties_and_biases_over_http_and_grpc_equal_the_offline_engine(served, oai, tiny_llm):
    """Disaggregated: the decode worker samples with the penalties' counts as a colocated
    engine does (repetition counts the prompt too)."""
    _, client, _ = served
    sampling = {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    bias = {226: -100.0, 7: 3.0}
    want = tiny_llm.generate(PROMPTS[1], greedy(12, ignore_eos=True, logit_bias=bias, **sampling))
    chat_want = tiny_llm.generate([MESSAGES], greedy(12, ignore_eos=True, **sampling))[0]
    extra = {"ignore_eos": True, "repetition_penalty": sampling["repetition_penalty"]}
    http = oai.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body=extra,
    )
    grpc = client.complete(
        PROMPTS[1], max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=bias, **sampling
    )
    assert http.choices[0].text == grpc.text == want[0].text
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        extra_body=extra,
    )
    assert chat.choices[0].message.content == chat_want.text


def test_usage_counts_cached_prompt_tokens(oai):
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can come from the cache
    first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The router learns where the blocks are from the workers' reports, a moment after the
    # answer: until then a repeat may be placed where they are not (and counts 0, truly).
    answers = []

    def repeat_is_cached() -> bool:
        answers.append(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2))
        return answers[-1].usage.prompt_tokens_details.cached_tokens == 32

    wait_until(repeat_is_cached, 20.0)
    assert answers[-1].usage.total_tokens == 42


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"n": 17}, 400, "n"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"extra_body": {"bogus": 1}}, 400, "bogus"),
        ({"prompt": "x" * 5000}, 400, "prompt"),
        ({"model": "not-this-one"}, 404, None),
        ({"extra_body": {"ttft_slo_s": 1e-9}}, 429, None),
    ],
    ids=["n", "temperature", "max_tokens", "unknown-field", "too-long", "model", "slo"],
)
def test_bad_requests_get_openai_error_objects(oai, kwargs, status, param):
    request = {"model": MODEL, "prompt": "fine", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        oai.completions.create(**request)
    error = caught.value
    assert error.status_code == status
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.body["param"] == param
    assert error.response.headers["x-request-id"]
    if status == 404:
        assert error.body["code"] == "model_not_found" and "'tiny'" in error.body["message"]
    assert error.response.headers.get("retry-after") == ("1" if status == 429 else None)
    assert oai.completions.create(model=MODEL, prompt="still serving", max_tokens=2)


def test_request_id_header_is_the_cluster_request_id(served, oai):
    _, client, _ = served
    raw = oai.completions.with_raw_response.create(
        model=MODEL, prompt="explain me", max_tokens=2, extra_headers={"X-Request-Id": "http-1"}
    )
    assert raw.headers["x-request-id"] == "http-1"
    assert raw.parse().id == "cmpl-http-1"
    assert "http-1" in client.explain("http-1")
    generated = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2
    )
    assert generated.parse().id == "chatcmpl-" + generated.headers["x-request-id"]


def test_models_health_and_metrics(served, oai):
    cluster, _, base = served
    assert [(m.id, m.owned_by) for m in oai.models.list().data] == [(MODEL, "halfmoon")]
    assert oai.models.retrieve(MODEL).id == MODEL
    health = httpx.get(base + "/health")
    assert (health.status_code, health.json()["status"]) == (200, "ok")
    metrics = httpx.get(base + "/metrics")
    assert metrics.status_code == 200 and "halfmoon_requests_total" in metrics.text
    ray.get(cluster.router.set_draining.remote("decode-1", True))
    try:
        unhealthy = httpx.get(base + "/health")
    finally:
        ray.get(cluster.router.set_draining.remote("decode-1", False))
    assert (unhealthy.status_code, unhealthy.headers["retry-after"]) == (503, "5")
    assert unhealthy.json()["reason"] == "no live decode worker (1 prefill, 0 decode)"
    assert httpx.get(base + "/health").status_code == 200


def test_a_request_id_in_flight_cannot_be_reused(served, oai):
    _, client, base = served
    headers = {"X-Request-Id": "twice"}
    body = {"model": MODEL, "prompt": "first", "stream": True, **LONG}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers) as first:
        events = (line for line in first.iter_lines() if line.startswith("data: "))
        next(events)
        with pytest.raises(openai.ConflictError) as caught:
            oai.completions.create(model=MODEL, prompt="second", extra_headers=headers)
        assert caught.value.body["code"] == "already_exists"
        assert "error" not in json.loads(next(events).removeprefix("data: "))
    wait_until(lambda: client.server_info().details["in_flight"] == 0, 60.0)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_the_request_on_every_worker(served, stream):
    cluster, client, base = served
    body = {"model": MODEL, "prompt": "abandon me", "stream": stream, **LONG}
    before = counters(cluster, "decode-1")["num_generated_tokens"]
    if stream:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: "))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(120, read=1.0))
    wait_until(lambda: client.server_info().details["in_flight"] == 0, 60.0)
    for name in ("prefill-0", "decode-1"):
        wait_until(lambda n=name: counters(cluster, n)["num_used_pages"] == 0, 60.0)
        assert counters(cluster, name)["num_running"] == 0
    generated = counters(cluster, "decode-1")["num_generated_tokens"] - before
    assert generated < LONG["max_tokens"]
