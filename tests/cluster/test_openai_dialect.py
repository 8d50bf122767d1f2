"""The dialect OpenAI and vLLM clients speak, over a real HTTP and gRPC server on a LocalBackend:
penalties and logit_bias on every API (the offline engine's greedy output), vLLM's extra fields
at their neutral values, precise refusals of what is not honoured, `echo`, GET /v1/models/{id},
Retry-After on 429 and 503, and the exact bodies `vllm bench serve` sends."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import jsonschema
import openai
import pytest

from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.frontend.drain import Drain
from halfmoon.cluster.frontend.http_protocol import REFUSAL
from halfmoon.cluster.frontend.http_server import OpenAIServer, start_http_server
from halfmoon.cluster.frontend.openai_fields import CHAT_NEUTRAL, COMPLETION_NEUTRAL, IGNORED_FIELDS
from halfmoon.cluster.frontend.openai_schema import ChatCompletionRequest, CompletionRequest
from halfmoon.cluster.serving.backend import ModelInfo, NoWorkerError, RejectedError
from halfmoon.engine import SamplingParams
from halfmoon.engine.errors import OutOfPagesError
from halfmoon.engine.structured_output import StructuredOutput
from halfmoon.engine.tokenizer import load_tokenizer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hi there"}]
NUM_TOKENS = 12
# Each changes the tiny model's greedy output (which repeats one token without them).
PENALIZED = [
    {"repetition_penalty": 1.5},
    {"frequency_penalty": 1.0},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2},
    {"logit_bias": {7: 100.0}},
    {"logit_bias": {226: -100.0, 63: -100.0}, "presence_penalty": 2.0},
]
# Every field an OpenAI or vLLM client may send that asks for nothing halfmoon lacks.
NEUTRAL_COMMON = {
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "logits_processors": None,
    "response_format": {"type": "text"},
    "guided_json": None,
    "guided_choice": None,
    "return_tokens_as_token_ids": False,
    "priority": 0,
    "vllm_xargs": None,
    "user": "someone",
    "metadata": {"team": "a"},
    "store": True,
    "service_tier": "auto",
    "top_k": -1,
    "min_p": 0.0,
}
NEUTRAL_COMPLETION = NEUTRAL_COMMON | {"echo": False, "suffix": None, "add_special_tokens": True}
NEUTRAL_CHAT = NEUTRAL_COMMON | {
    "tool_choice": "none",
    "parallel_tool_calls": True,
    "functions": [],
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
    "chat_template_kwargs": {},
    "modalities": ["text"],
    "bad_words": [],
    "prediction": {"type": "content", "content": "whatever"},
}


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kwargs)


def _http_fields(kwargs: dict) -> dict:
    """Sampling kwargs as an OpenAI body has them: logit_bias keys are strings."""
    bias = kwargs.get("logit_bias")
    return kwargs | ({"logit_bias": {str(t): b for t, b in bias.items()}} if bias else {})


def _post(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(api.base_url + path, json={"model": api.model, **body}, timeout=60)


def _events(api, path: str, body: dict) -> list:
    """The `data:` payloads of a streamed answer, JSON-decoded but for the last ([DONE])."""
    with httpx.stream("POST", api.base_url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("kwargs", PENALIZED, ids=lambda kw: "+".join(kw))
def test_penalties_and_biases_give_the_offline_greedy_output_on_every_api(
    api, oai, tiny_llm, kwargs
):
    plain, want = tiny_llm.generate([PROMPT, PROMPT], [greedy(), greedy(**kwargs)])
    chat_want = tiny_llm.generate([MESSAGES], greedy(**kwargs))[0]
    assert want.text != plain.text  # the field took effect
    common = {"model": api.model, "max_tokens": NUM_TOKENS, "temperature": 0}
    extra = {"ignore_eos": True, **_http_fields(kwargs)}
    completion = oai.completions.create(prompt=PROMPT, extra_body=extra, **common)
    assert completion.choices[0].text == want.text
    chat = oai.chat.completions.create(messages=MESSAGES, extra_body=extra, **common)
    assert chat.choices[0].message.content == chat_want.text
    streamed = oai.completions.create(prompt=PROMPT, stream=True, extra_body=extra, **common)
    assert "".join(c.choices[0].text for c in streamed) == want.text
    with Client(api.grpc_address) as client:
        grpc_text = client.complete(
            PROMPT, max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **kwargs
        ).text
    assert grpc_text == want.text


def test_a_logit_bias_of_100_forces_the_token_and_minus_100_bans_it(api, tiny_llm):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    forced = _post(api, "/completions", {**body, "logit_bias": {"7": 100}}).json()
    assert forced["choices"][0]["text"] == tiny_llm.tokenizer.decode([7] * 6)
    plain = tiny_llm.generate(PROMPT, greedy())[0]
    first = plain.token_ids[0]
    banned = tiny_llm.generate(PROMPT, greedy(logit_bias={first: -100.0}))[0]
    assert banned.token_ids[0] != first
    answer = _post(api, "/completions", {**body, "logit_bias": {str(first): -100}}).json()
    assert answer["choices"][0]["text"] == tiny_llm.tokenizer.decode(banned.token_ids[:6])


@pytest.mark.parametrize(
    ("path", "neutral", "prompt"),
    [
        ("/completions", NEUTRAL_COMPLETION, {"prompt": PROMPT}),
        ("/chat/completions", NEUTRAL_CHAT, {"messages": MESSAGES}),
    ],
    ids=["completions", "chat"],
)
def test_neutral_extras_of_openai_and_vllm_clients_are_taken_and_change_nothing(
    api, path, neutral, prompt
):
    body = {**prompt, "max_tokens": 8, "temperature": 0}
    plain = _post(api, path, body)
    extras = _post(api, path, {**body, **neutral})
    assert (plain.status_code, extras.status_code) == (200, 200), extras.text
    choice = extras.json()["choices"][0]
    assert choice == plain.json()["choices"][0]


@pytest.mark.parametrize(
    ("path", "field", "value", "reason"),
    [
        ("/completions", "n", 17, "[1, 16]"),
        ("/completions", "best_of", 3, "best_of=1"),
        ("/completions", "use_beam_search", True, "beam search"),
        ("/completions", "min_tokens", 4, "min_tokens"),
        ("/completions", "include_stop_str_in_output", True, "stop string"),
        ("/completions", "skip_special_tokens", False, "special tokens"),
        ("/completions", "prompt_logprobs", 1, "prompt log-probabilities"),
        ("/completions", "suffix", "end", "suffix"),
        ("/completions", "structural_tag", "{}", "not supported"),
        ("/completions", "guided_regex", "((", "parenthesis"),
        ("/completions", "allowed_token_ids", [1, 2], "logit_bias"),
        ("/completions", "priority", 5, "priorities"),
        ("/completions", "frequency_penalty", 2.5, "[-2, 2]"),
        ("/completions", "presence_penalty", -3, "[-2, 2]"),
        ("/completions", "repetition_penalty", 0, "> 0"),
        ("/completions", "logit_bias", {"abc": 1}, "decimal strings"),
        ("/completions", "logit_bias", {"-1": 1}, "decimal strings"),
        ("/completions", "logit_bias", {"99999": 1}, "[0, 262)"),
        ("/completions", "logit_bias", {"5": 101}, "[-100, 100]"),
        ("/completions", "tools", [{"type": "function"}], "unknown field"),
        ("/completions", "bogus", 1, "unknown field"),
        ("/chat/completions", "n", 0, "[1, 16]"),
        ("/chat/completions", "guided_json", {"type": "no-such-type"}, "no-such-type"),
        (
            "/chat/completions",
            "tools",
            [{"type": "function", "function": {"name": "f"}}] * 2,
            "twice",
        ),
        ("/chat/completions", "tool_choice", "required", "needs tools"),
        ("/chat/completions", "functions", [{"name": "f"}], "legacy functions"),
        ("/chat/completions", "tools", 5, "valid array"),
        ("/chat/completions", "tool_choice", {"type": "function"}, '"required"'),
        ("/chat/completions", "echo", True, "echoing"),
        ("/chat/completions", "continue_final_message", True, "assistant turn"),
        ("/chat/completions", "chat_template", "{{ x }}", "chat template"),
        ("/chat/completions", "reasoning_effort", "high", "reasoning"),
        ("/chat/completions", "logit_bias", {"1.5": 3}, "decimal strings"),
    ],
)
def test_a_value_that_would_change_the_output_and_is_not_honoured_is_a_400_naming_it(
    api, path, field, value, reason
):
    prompt = {"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES}
    answer = _post(api, path, {**prompt, "max_tokens": 2, field: value})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (field, "invalid_argument")
    assert reason in error["message"]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(api, path):
    """guidellm's stream_options: each chunk's usage counts the tokens streamed up to it."""
    prompt = {"prompt": PROMPT} if path == "/completions" else {"messages": MESSAGES}
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**prompt, "model": api.model, "max_tokens": 5, "ignore_eos": True, "stream": True}
    chunks = _events(api, path, {**body, "stream_options": options})
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 5
    running = [c["usage"] for c in chunks[:-1]]
    assert all(u["prompt_tokens"] == final["prompt_tokens"] > 0 for u in running)
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)


def test_continuous_usage_stats_without_include_usage_sends_no_usage(api):
    options = {"continuous_usage_stats": True}
    body = {"prompt": PROMPT, "model": api.model, "max_tokens": 3, "stream": True}
    chunks = _events(api, "/completions", {**body, "stream_options": options})
    assert chunks and all("usage" not in c for c in chunks)


def test_grpc_takes_penalties_and_biases_and_names_a_bad_one(api):
    with Client(api.grpc_address) as client:
        forced = client.complete(PROMPT, max_tokens=3, temperature=0.0, logit_bias={7: 100.0})
        assert forced.token_ids == [7, 7, 7]
        for bad, field in [
            ({"frequency_penalty": 9.0}, "frequency_penalty"),
            ({"repetition_penalty": -1.0}, "repetition_penalty"),
            ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
            ({"logit_bias": {3: 500.0}}, "logit_bias"),
        ]:
            with pytest.raises(ServerError) as caught:
                client.complete(PROMPT, max_tokens=2, **bad)
            assert caught.value.code == "INVALID_ARGUMENT" and field in caught.value.message


def test_echo_puts_the_prompt_before_the_completion(api, tiny_llm):
    want = tiny_llm.generate(PROMPT, greedy())[0].text
    body = {"model": api.model, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    whole = _post(api, "/completions", {**body, "prompt": PROMPT, "echo": True}).json()
    assert whole["choices"][0]["text"] == PROMPT + want
    chunks = _events(api, "/completions", {**body, "prompt": PROMPT, "echo": True, "stream": True})
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + want
    ids = tiny_llm.tokenizer.encode(PROMPT)
    by_ids = _post(api, "/completions", {**body, "prompt": ids, "echo": True}).json()
    echoed = tiny_llm.tokenizer.decode(ids, skip_special_tokens=True)
    assert by_ids["choices"][0]["text"] == echoed + want
    with_logprobs = _post(
        api, "/completions", {**body, "prompt": PROMPT, "echo": True, "logprobs": 1}
    )
    assert with_logprobs.status_code == 400 and with_logprobs.json()["error"]["param"] == "echo"


def test_models_by_id_answers_the_served_model_and_404_for_any_other(api, oai):
    card = oai.models.retrieve(api.model)
    assert (card.id, card.object, card.owned_by) == (api.model, "model", "halfmoon")
    assert card.model_dump() == oai.models.list().data[0].model_dump()
    for other in ("gpt-4", "org/some-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            oai.models.retrieve(other)
        assert caught.value.body["code"] == "model_not_found"
        assert repr(other) in caught.value.body["message"]


def test_vllm_bench_serve_probe_bodies_stream_tokens_and_usage(api):
    """The bodies `vllm bench serve` sends (vllm/benchmarks/lib/endpoint_request_func.py), as
    its readiness probe does: --backend openai, then openai-chat, with --ignore-eos and the
    temperature 0 it adds when none is given."""
    completions = {
        "model": api.model,
        "prompt": PROMPT,
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    chat = {
        "model": api.model,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    for path, body, key in [
        ("/completions", completions, "text"),
        ("/chat/completions", chat, "delta"),
    ]:
        chunks = _events(api, path, body)
        assert any(c["choices"] and c["choices"][0][key] for c in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


class RefusingBackend:
    """A backend whose every request fails with `error`, and whose health is down."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def generate(self, request):
        raise self.error
        yield

    async def health(self) -> tuple[bool, str]:
        return False, "no live decode worker (1 prefill, 0 decode)"


@contextmanager
def serve_refusing(error: BaseException, drain: Drain | None = None) -> Iterator[str]:
    """The HTTP API over a `RefusingBackend`; yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    model = ModelInfo("m", "llama", 262, 64, 16)
    app = OpenAIServer(RefusingBackend(error), None, model, drain=drain).app
    server, port = asyncio.run_coroutine_threadsafe(start_http_server(app, port=0), loop).result()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.mark.parametrize(
    ("error", "status", "seconds"),
    [
        (RejectedError("predicted TTFT breaks the SLO"), 429, "1"),
        (OutOfPagesError(4, 1), 503, "1"),
        (NoWorkerError("no live decode worker"), 503, "5"),
    ],
    ids=["rejected", "out-of-pages", "no-worker"],
)
def test_429_and_503_answers_carry_retry_after(error, status, seconds):
    body = {"prompt": "hi", "max_tokens": 2}
    with serve_refusing(error) as base:
        for stream in (False, True):
            answer = httpx.post(base + "/v1/completions", json={**body, "stream": stream})
            assert (answer.status_code, answer.headers.get("retry-after")) == (status, seconds)
        health = httpx.get(base + "/health")
        assert (health.status_code, health.headers["retry-after"]) == (503, "5")
        assert "retry-after" not in httpx.post(base + "/v1/completions", json={}).headers
    assert REFUSAL.headers["retry-after"] == "1"  # the connection cap's 503


def test_while_draining_retry_after_is_the_time_left_in_the_drain():
    drain = Drain()
    with serve_refusing(NoWorkerError("unused"), drain) as base:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(drain.drain(30.0))  # nothing in flight: returns at once
        loop.close()
        refused = httpx.post(base + "/v1/completions", json={"prompt": "hi"})
        health = httpx.get(base + "/health")
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert 28 <= int(refused.headers["retry-after"]) <= 30
    assert 28 <= int(health.headers["retry-after"]) <= 30


def test_docs_list_every_field_either_endpoint_takes():
    docs = DOCS.read_text()
    fields = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields}
    fields |= {*IGNORED_FIELDS, *COMPLETION_NEUTRAL, *CHAT_NEUTRAL}
    assert sorted(f for f in fields if f"`{f}`" not in docs) == []


def test_null_is_the_same_as_leaving_a_field_out(api):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    nulls = {"n": None, "stream": None, "echo": None, "logit_bias": None, "guided_json": None}
    plain, with_nulls = (
        _post(api, "/completions", body),
        _post(api, "/completions", {**body, **nulls}),
    )
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["choices"] == plain.json()["choices"]
    chat = {"messages": MESSAGES, "max_tokens": 4, "logprobs": None, "tool_choice": None}
    assert _post(api, "/chat/completions", chat).status_code == 200


@pytest.mark.parametrize("path", ["/models", "/models/{model}", "/../health", "/../metrics"])
def test_head_answers_what_get_answers_without_a_body(api, path):
    url = api.base_url + path.format(model=api.model)
    head, get = httpx.head(url, timeout=30), httpx.get(url, timeout=30)
    assert head.status_code == get.status_code  # /metrics: 404, this server has no registry
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_tokenize_and_detokenize_speak_vllms_alignment_calls(api, tiny_model_dir):
    """The calls `vllm bench serve` makes to align its prompts to the server's tokenizer."""
    tokenizer = load_tokenizer(tiny_model_dir)
    base = api.base_url.removesuffix("/v1")
    body = {"model": api.model, "prompt": PROMPT, "add_special_tokens": False}
    answer = httpx.post(base + "/tokenize", json=body, timeout=30).json()
    assert answer["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] > 0
    with_bos = httpx.post(base + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert with_bos["tokens"] == tokenizer.encode(PROMPT)
    text = httpx.post(base + "/detokenize", json={"tokens": answer["tokens"]}, timeout=30)
    assert text.json() == {"prompt": tokenizer.decode(answer["tokens"])}


def test_tokenize_messages_counts_what_a_chat_request_is_charged(api):
    base = api.base_url.removesuffix("/v1")
    counted = httpx.post(base + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    charged = _post(api, "/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert counted["count"] == charged["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, None),
        ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "truncate"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_bad_bodies_naming_the_field(api, path, body, status, param):
    answer = httpx.post(api.base_url.removesuffix("/v1") + path, json=body, timeout=30)
    assert answer.status_code == status
    assert answer.json()["error"]["param"] == param


def test_grpc_n_streams_every_choice_as_the_http_api_does(api):
    sampled = {"max_tokens": 6, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    with Client(api.grpc_address) as client:
        result = client.complete(PROMPT, n=3, **sampled)
    body = {"prompt": PROMPT, "n": 3, **sampled}
    http = _post(api, "/completions", body).json()
    assert [c.text for c in result.choices] == [c["text"] for c in http["choices"]]
    assert [len(c.token_ids) for c in result.choices] == [6, 6, 6]
    assert result.text == result.choices[0].text and result.usage.completion_tokens == 18


def test_grpc_structured_output_holds_the_text_to_the_schema(api):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    held = StructuredOutput("json", json.dumps(schema))
    with Client(api.grpc_address) as client:
        result = client.complete(PROMPT, max_tokens=60, structured_output=held)
    jsonschema.validate(json.loads(result.text), schema)
    assert result.finish_reason == "stop"


HELD = "sampling.structured_output"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"structured_output": StructuredOutput("xml", "<a/>")}, HELD),
        ({"structured_output": StructuredOutput("json", "{not json")}, HELD),
        ({"structured_output": StructuredOutput("regex", "(")}, HELD),
    ],
)
def test_grpc_names_a_bad_n_or_structured_output(api, sampling, field):
    with Client(api.grpc_address) as client, pytest.raises(ServerError) as caught:
        client.complete(PROMPT, max_tokens=2, **sampling)
    assert caught.value.code == "INVALID_ARGUMENT" and field in caught.value.message
