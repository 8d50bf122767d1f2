"""Model options on a live cluster: the served name and the context limit reach clients, and
`status` names the kernels each worker runs."""

from __future__ import annotations

import pytest
from cluster_kit import running_cluster

from halfmoon.cluster.client.grpc_client import ServerError
from halfmoon.kernels import cpu_build

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.timeout(240)
def test_served_model_name_and_max_model_len_reach_clients(tiny_model_dir):
    options = {"mode": "colocated", "served_model_name": "my-model", "engine.max_model_len": 256}
    with running_cluster(tiny_model_dir, **options) as (_, client):
        info = client.model_info()
        assert (info.model, info.max_model_len) == ("my-model", 256)
        details = client.server_info().details
        assert details["model"] == "my-model"
        # Each worker says which CPU kernel variant and linear path run its model.
        variant = cpu_build.current().name
        for worker in details["workers"].values():
            assert worker["kernels"].startswith(f"{variant} kernels, linear ")
        with pytest.raises(ServerError) as error:
            client.complete("x" * 300, max_tokens=4)
        assert error.value.code == "INVALID_ARGUMENT"
        assert "context length of 256 tokens" in error.value.message
        assert client.complete("x" * 200, max_tokens=4, temperature=0.0).usage.prompt_tokens == 200
