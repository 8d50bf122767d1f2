"""The API key on both APIs, the HTTP error mapping, the config and CLI options of the OpenAI
API, and the default chat template: checks that need no cluster (a real gRPC and HTTP server
over a LocalBackend where a server is needed)."""

from __future__ import annotations

import json

import grpc
import httpx2 as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_testkit import serve_openai

from halfmoon.cluster.cli import build_parser, main
from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.config import ConfigError, load_config, validate_config
from halfmoon.cluster.frontend.http_errors import http_error
from halfmoon.cluster.serving.backend import (
    DuplicateRequestError,
    ModelNotFoundError,
    NoWorkerError,
    RejectedError,
    UnauthenticatedError,
)
from halfmoon.engine.errors import InvalidRequestError, OutOfPagesError
from halfmoon.engine.init_model import build_tokenizer
from halfmoon.engine.tokenizer import tokenize_prompt

KEY = "sekret-key"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with serve_openai(tiny_model_dir, api_key=KEY) as api:
        yield api


def _openai(api, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url, api_key=key, max_retries=0)


def test_http_without_the_api_key_gets_401_but_health_is_open(keyed):
    with pytest.raises(openai.AuthenticationError) as caught:
        _openai(keyed, "wrong").completions.create(model=keyed.model, prompt="hi", max_tokens=2)
    assert (caught.value.status_code, caught.value.body["code"]) == (401, "invalid_api_key")
    body = {"model": keyed.model, "prompt": "hi", "max_tokens": 2}
    missing = httpx.post(keyed.base_url + "/completions", json=body)
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "invalid_api_key")
    assert httpx.get(keyed.base_url.removesuffix("/v1") + "/health").status_code == 200


def test_a_bad_request_id_without_the_key_gets_401_and_with_it_400(keyed):
    body = {"model": keyed.model, "prompt": "hi", "max_tokens": 2}
    bad_id = {"X-Request-Id": "x" * 10_000}
    anonymous = httpx.post(keyed.base_url + "/completions", json=body, headers=bad_id)
    assert anonymous.status_code == 401
    keyed_call = httpx.post(
        keyed.base_url + "/completions",
        json=body,
        headers={**bad_id, "Authorization": f"Bearer {KEY}"},
    )
    assert keyed_call.status_code == 400
    assert keyed_call.json()["error"]["param"] == "X-Request-Id"


def test_a_lone_surrogate_escape_is_named_as_such(keyed):
    body = b'{"model": "m", "prompt": "a\\ud800b", "max_tokens": 2}'
    answer = httpx.post(
        keyed.base_url + "/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 400
    assert "lone surrogate" in answer.json()["error"]["message"]


def test_every_http_answer_carries_a_request_id(keyed):
    root = keyed.base_url.removesuffix("/v1")
    answers = [
        httpx.get(root + "/health"),
        httpx.get(root + "/metrics"),
        httpx.get(root + "/v1/nope"),
        httpx.get(keyed.base_url + "/completions"),
        httpx.post(keyed.base_url + "/completions", json={}),  # 401 before anything is judged
    ]
    statuses = [answer.status_code for answer in answers]
    assert statuses == [200, 404, 404, 405, 401]
    assert all(len(answer.headers["x-request-id"]) == 32 for answer in answers)


def test_http_with_the_api_key_is_served(keyed):
    chunks = _openai(keyed, KEY).chat.completions.create(
        model=keyed.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},  # a sampled end of text within 3 tokens is "stop"
    )
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_grpc_without_the_api_key_is_unauthenticated_except_health(keyed):
    with Client(keyed.grpc_address) as client, pytest.raises(ServerError) as caught:
        client.complete("hi", max_tokens=2)
    assert caught.value.code == "UNAUTHENTICATED" and caught.value.from_server
    with Client(keyed.grpc_address, api_key=KEY) as client:
        assert len(client.complete("hi", max_tokens=2, ignore_eos=True).token_ids) == 2
    with grpc.insecure_channel(keyed.grpc_address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_takes_the_api_key_from_the_flag_or_the_environment(keyed, monkeypatch, capsys):
    status = ["status", "--server", keyed.grpc_address, "--json"]
    assert main(status) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*status, "--api-key", KEY]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "local"
    monkeypatch.setenv("HALFMOON_API_KEY", KEY)
    assert main(["generate", "--server", keyed.grpc_address, "--max-tokens", "2", "hi"]) == 0


@pytest.mark.parametrize(
    ("error", "status", "param", "code"),
    [
        (InvalidRequestError("top_p", 2.0, "must be in (0, 1]"), 400, "top_p", "invalid_argument"),
        (UnauthenticatedError("no key"), 401, None, "invalid_api_key"),
        (ModelNotFoundError("no such model"), 404, None, "model_not_found"),
        (DuplicateRequestError("request_id='x' is in flight"), 409, None, "already_exists"),
        (RejectedError("predicted TTFT too long"), 429, None, "resource_exhausted"),
        (NoWorkerError("no decode worker"), 503, None, "unavailable"),
        (OutOfPagesError(4, 1), 503, None, "unavailable"),
        (RuntimeError("secret internals"), 500, None, "internal"),
    ],
)
def test_errors_map_to_the_http_status_of_their_grpc_code(error, status, param, code):
    got_status, body = http_error(error)
    assert (got_status, body["error"]["param"], body["error"]["code"]) == (status, param, code)
    assert "secret internals" not in body["error"]["message"]


@pytest.mark.parametrize("value", ["off", None, False])
def test_http_port_off_or_null_serves_no_http_api(value):
    assert validate_config({"server": {"http_port": value}}).server.http_port is None


def test_cli_http_port_off_reaches_the_config():
    args = build_parser().parse_args(["serve", "--http-port", "off"])
    assert load_config(None, {"server.http_port": args.http_port}).server.http_port is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--http-port", "eighty"])


def test_http_port_must_differ_from_the_other_ports_and_the_key_stays_secret():
    with pytest.raises(ConfigError, match="server.http_port: 50051 is also grpc_port"):
        load_config(None, {"server.http_port": 50051})
    config = load_config(None, {"server.api_key": KEY, "server.http_port": 0})
    assert config.server.http_port == 0
    assert config.server.api_key.get_secret_value() == KEY
    assert KEY not in repr(config) and KEY not in str(config)


def test_messages_use_a_default_template_when_the_tokenizer_has_none():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    got = tokenize_prompt(tokenizer, messages, len(tokenizer))
    text = "system: be brief\nuser: hi\nassistant:"
    assert got == tokenizer.encode(text, add_special_tokens=False)


def test_http_requests_obey_the_request_limits_and_the_drain(tiny_model_dir):
    import asyncio

    from halfmoon.cluster.frontend.drain import Drain
    from halfmoon.cluster.frontend.request_limits import RequestLimits

    limits = RequestLimits(max_stop_strings=2, max_prompt_bytes=1000)
    drain = Drain()
    with serve_openai(tiny_model_dir, limits=limits, drain=drain) as api:
        url = api.base_url + "/completions"
        body = {"model": api.model, "prompt": "hi", "max_tokens": 2}
        stops = httpx.post(url, json={**body, "stop": ["a", "b", "c"]})
        assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
        seed = httpx.post(url, json={**body, "seed": 2**63})
        assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed"
        huge = httpx.post(url, json={**body, "prompt": "x" * 2_000_000})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "body"
        assert httpx.post(url, json=body).status_code == 200
        asyncio.run_coroutine_threadsafe(drain.drain(0.0), api.loop).result()
        refused = httpx.post(url, json=body)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        health = httpx.get(api.base_url.removesuffix("/v1") + "/health")
        assert health.status_code == 503 and health.json()["reason"] == "shutting down"
