"""The API-key family of the HTTP tests (test_openai_local, written against a LocalBackend), run
again through the router actor's ClusterBackend in a live colocated cluster that requires a
key: the test functions are that module's own, collected here with this module's `keyed`."""

from __future__ import annotations

import grpc
import pytest
from cluster_kit import running_cluster, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http_testkit import RunningApi
from test_openai_local import (  # noqa: F401 - collected here, through the cluster
    KEY,
    test_a_bad_request_id_without_the_key_gets_401_and_with_it_400,
    test_a_lone_surrogate_escape_is_named_as_such,
    test_grpc_without_the_api_key_is_unauthenticated_except_health,
    test_http_with_the_api_key_is_served,
    test_http_without_the_api_key_gets_401_but_health_is_open,
)

from halfmoon.cluster.client.grpc_client import Client

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def keyed(tiny_model_dir) -> RunningApi:
    settings = {"mode": "colocated", "server.api_key": KEY}
    with running_cluster(tiny_model_dir, **settings) as (cluster, _):
        grpc_address = f"127.0.0.1:{cluster.ports['grpc_port']}"
        base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
        with Client(grpc_address, api_key=KEY) as client:
            model = client.model_info().model
        # gRPC health follows the backend's, polled: SERVING a moment after start.
        wait_until(lambda: _health(grpc_address) == health_pb2.HealthCheckResponse.SERVING)
        yield RunningApi(grpc_address, base_url, model, loop=None)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
