"""Oversized and malformed requests are refused before any work, with short messages."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from grpc_testkit import serve_model

from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.frontend.grpc_errors import MAX_MESSAGE_CHARS, bounded
from halfmoon.cluster.frontend.request_limits import (
    RequestLimits,
    check_messages,
    check_stops,
    check_text,
)
from halfmoon.engine.errors import InvalidRequestError

LIMITS = RequestLimits()
GENERATE = "/halfmoon.v1.Halfmoon/Generate"
ABORT = "/halfmoon.v1.Halfmoon/Abort"


def rejection(call) -> ServerError:
    with pytest.raises(ServerError) as caught:
        call()
    return caught.value


def test_text_limits_count_characters_and_utf8_bytes():
    limits = RequestLimits(max_prompt_chars=10, max_prompt_bytes=12)
    check_text("a" * 10, limits)
    with pytest.raises(InvalidRequestError, match=r"<11 characters>.*at most 10 characters"):
        check_text("a" * 11, limits)
    with pytest.raises(InvalidRequestError, match=r"<17 bytes>.*at most 12 bytes"):
        check_text("é" * 5 + "€" + "aaaa", limits)  # 10 characters, 10 + 3 + 4 bytes


def test_chat_limits_count_messages_and_their_contents_together():
    limits = RequestLimits(max_chat_messages=3, max_prompt_chars=10)
    check_messages(["abc", "def", "ghij"], limits)
    with pytest.raises(InvalidRequestError, match=r"<4 messages>"):
        check_messages(["a"] * 4, limits)
    with pytest.raises(InvalidRequestError, match=r"<12 characters>"):
        check_messages(["abcdef", "ghijkl"], limits)


def test_stop_limits_count_strings_bytes_and_token_ids():
    limits = RequestLimits(max_stop_strings=2, max_stop_bytes=8, max_stop_token_ids=1)
    check_stops(["abcd", "efgh"], 1, limits)
    with pytest.raises(InvalidRequestError, match=r"stop=.*<3 strings>"):
        check_stops(["a", "b", "c"], 0, limits)
    with pytest.raises(InvalidRequestError, match=r"<9 bytes>"):
        check_stops(["abcd", "efghi"], 0, limits)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids=.*<2 ids>"):
        check_stops([], 2, limits)


def test_bounded_cuts_long_messages_and_says_how_much():
    assert bounded("short") == "short"
    cut = bounded("x" * 5000)
    assert cut == "x" * MAX_MESSAGE_CHARS + f"... ({5000 - MAX_MESSAGE_CHARS} more characters)"


def test_ten_thousand_stop_strings_are_invalid_with_a_short_message(server):
    stops = [f"stop-{i}" for i in range(10_000)]
    with Client(server.address) as client:
        error = rejection(lambda: client.complete("hello", max_tokens=2, stop=stops))
    assert error.code == "INVALID_ARGUMENT" and error.from_server
    assert error.message == (
        "stop='<10000 strings>' is invalid: "
        "at most 32 stop strings allowed (limits.max_stop_strings)"
    )


def test_an_oversized_prompt_is_invalid_at_once(server):
    with Client(server.address) as client:
        error = rejection(lambda: client.complete("a" * (LIMITS.max_prompt_chars + 1)))
        chat = [{"role": "user", "content": "hi"}] * (LIMITS.max_chat_messages + 1)
        too_many = rejection(lambda: client.complete(chat))
        ids = rejection(lambda: client.complete([1] * (LIMITS.max_prompt_token_ids + 1)))
        assert client.complete("hello", max_tokens=2, ignore_eos=True).finish_reason == "length"
    assert error.code == too_many.code == ids.code == "INVALID_ARGUMENT"
    assert f"<{LIMITS.max_prompt_chars + 1} characters>" in error.message
    assert f"<{LIMITS.max_chat_messages + 1} messages>" in too_many.message
    assert f"<{LIMITS.max_prompt_token_ids + 1} ids>" in ids.message
    assert server.wait_until_idle()


def test_request_ids_are_bounded_in_generate_and_abort(server):
    long_id = "r" * (LIMITS.max_request_id_chars + 1)
    with Client(server.address) as client:
        generate = rejection(lambda: client.complete("hello", request_id=long_id))
        abort = rejection(lambda: client.abort(long_id))
        explain = rejection(lambda: client.explain(long_id))
    for error in (generate, abort, explain):
        assert error.code == "INVALID_ARGUMENT"
        assert f"is {len(long_id)} characters; at most 256 allowed" in error.message
        assert len(error.message) < 200


@pytest.mark.parametrize("method", [GENERATE, ABORT])
def test_undecodable_bytes_are_invalid_argument_without_internal_names(server, method):
    with grpc.insecure_channel(server.address) as channel:
        if method == GENERATE:
            call = channel.unary_stream(method)
            with pytest.raises(grpc.RpcError) as caught:
                list(call(b"\xff\xff\xff\xff", timeout=30))
        else:
            call = channel.unary_unary(method)
            with pytest.raises(grpc.RpcError) as caught:
                call(b"\x0a\xff\xff\xff\x0f", timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    name = "GenerateRequest" if method == GENERATE else "AbortRequest"
    assert caught.value.details() == f"the request is not a valid {name} message"


def openssl_self_signed(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_tls_server_answers_clients_that_trust_its_ca_only(tiny_model_dir, tmp_path):
    cert, key = openssl_self_signed(tmp_path)
    with open(cert, "rb") as c, open(key, "rb") as k:
        tls = (c.read(), k.read())
    with serve_model(tiny_model_dir, tls=tls) as running:
        with Client(running.address, tls_ca=cert) as client:
            assert client.complete("hello", max_tokens=3, ignore_eos=True).finish_reason == "length"
        with Client(running.address) as plaintext:
            error = rejection(lambda: plaintext.model_info(timeout=10))
    assert error.code == "UNAVAILABLE" and error.unreachable


def test_drain_refuses_new_requests_and_lets_the_stream_in_flight_finish(tiny_model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from halfmoon.cluster.frontend.drain import Drain

    drain = Drain()
    with serve_model(tiny_model_dir, drain=drain) as running, Client(running.address) as client:
        stream = client.generate("hello", max_tokens=40, ignore_eos=True)
        first = next(stream)
        assert drain.active == 1
        left = running.run(drain.drain(timeout_s=0))  # begin draining; do not wait here
        refused = rejection(lambda: client.complete("new", max_tokens=2))
        with grpc.insecure_channel(running.address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            status = check(health_pb2.HealthCheckRequest(service="halfmoon.v1.Halfmoon")).status
        num_tokens = len(first.token_ids) + sum(len(delta.token_ids) for delta in stream)
        assert running.run(drain.drain(timeout_s=60)) == 0
    assert left == 1 and status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code == "UNAVAILABLE" and refused.from_server
    assert refused.message == "the server is shutting down; send the request elsewhere"
    assert num_tokens == 40
