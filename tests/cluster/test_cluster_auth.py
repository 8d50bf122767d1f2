"""The API key and TLS through the real router actor (the frontend tests use LocalBackend):
gRPC and HTTP over TLS with a key, and what a caller without either gets."""

from __future__ import annotations

import openai
import pytest
from cluster_kit import running_cluster
from test_request_limits import openssl_self_signed

from halfmoon.cluster.client.grpc_client import Client, ServerError

KEY = "a-cluster-key-of-thirty-two-chars"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]


def test_a_cluster_with_a_key_and_tls_serves_only_callers_with_both(tiny_model_dir, tmp_path):
    cert, key = openssl_self_signed(tmp_path)
    settings = {"server.api_key": KEY, "server.tls_cert": cert, "server.tls_key": key}
    with running_cluster(tiny_model_dir, **settings) as (cluster, _):
        grpc_address = f"127.0.0.1:{cluster.ports['grpc_port']}"
        base_url = f"https://127.0.0.1:{cluster.ports['http_port']}/v1"
        with Client(grpc_address, tls_ca=cert, api_key=KEY) as keyed:
            assert keyed.complete("hello", max_tokens=3, ignore_eos=True).finish_reason == "length"
        wrong = Client(grpc_address, tls_ca=cert, api_key="wrong")
        with wrong, pytest.raises(ServerError) as unkeyed:
            wrong.complete("hello", max_tokens=3)
        plaintext = Client(grpc_address, api_key=KEY)
        with plaintext, pytest.raises(ServerError) as untrusted:
            plaintext.model_info(timeout=10)
        trusting = openai.DefaultHttpxClient(verify=cert)
        with openai.OpenAI(
            base_url=base_url, api_key=KEY, max_retries=0, http_client=trusting
        ) as client:
            model = client.models.list().data[0].id
            done = client.completions.create(model=model, prompt="hi", max_tokens=2)
        anonymous = openai.OpenAI(
            base_url=base_url,
            api_key="wrong",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=cert),
        )
        with anonymous, pytest.raises(openai.AuthenticationError) as refused:
            anonymous.completions.create(model=model, prompt="hi", max_tokens=2)
        # HTTPS only: plain HTTP to the port, or a client that does not trust the CA, fail.
        for url, verify in ((base_url.replace("https", "http"), True), (base_url, True)):
            stranger = openai.OpenAI(
                base_url=url,
                api_key=KEY,
                max_retries=0,
                http_client=openai.DefaultHttpxClient(verify=verify),
            )
            with stranger, pytest.raises(openai.APIConnectionError):
                stranger.models.list()
    assert unkeyed.value.code == "UNAUTHENTICATED"
    assert untrusted.value.code == "UNAVAILABLE"
    assert done.usage.completion_tokens == 2
    assert refused.value.status_code == 401
