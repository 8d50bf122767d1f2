"""SIGTERM drains `halfmoon serve`: new requests are refused, the streams in flight finish."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
from cache_testkit import cache_with_built_kernels
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_testkit import wait_for
from serve_testkit import start_serve
from test_cluster_process import _alive, _descendants, _name, _wait_for_line

from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.kvstore.redis_server import free_port

pytestmark = pytest.mark.slow
NUM_STREAMS = 4
MAX_TOKENS = 600


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


@pytest.mark.timeout(600)
def test_sigterm_lets_long_streams_finish_and_refuses_new_requests(tiny_model_dir, tmp_path):
    port, metrics_port = free_port(), free_port()
    # halfmoon's default: token auth for the Ray it starts, the token made under this HOME.
    home = tmp_path / "home"
    home.mkdir()
    unset = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    env |= {"HALFMOON_CACHE": str(cache_with_built_kernels(tmp_path / "cache")), "HOME": str(home)}
    serve = start_serve(
        tiny_model_dir,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--drain-timeout",
        "300",
        env=env,
    )
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_line(serve, "gRPC", timeout_s=300)
        started = _descendants(serve.pid)
        ray_core = [pid for pid in started if _name(pid) in ("gcs_server", "raylet")]
        assert ray_core and {_auth_mode(pid) for pid in ray_core} == {"token"}
        assert (home / ".ray" / "auth_token").is_file()
        # Health follows the workers every 0.5 s: SERVING once both pools have registered.
        assert wait_for(lambda: _health(address) == health_pb2.HealthCheckResponse.SERVING, 30)
        with Client(address) as client:
            streams = [
                client.generate(f"stream {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
                for i in range(NUM_STREAMS)
            ]
            firsts = [next(stream) for stream in streams]  # every stream is under way
            serve.send_signal(signal.SIGTERM)
            signalled_s = time.monotonic()
            assert wait_for(
                lambda: _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, 60
            )
            not_serving_s = time.monotonic() - signalled_s
            with pytest.raises(ServerError) as refused:
                client.complete("a new request", max_tokens=2)
            counts = [len(first.token_ids) for first in firsts]
            reasons = [None] * NUM_STREAMS
            for i, stream in enumerate(streams):
                for delta in stream:
                    counts[i] += len(delta.token_ids)
                    reasons[i] = delta.finish_reason or reasons[i]
            streams_done_s = time.monotonic() - signalled_s
        output = _drain_output(serve, timeout_s=300)
        exited_s = time.monotonic() - signalled_s
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=60)
    assert refused.value.code == "UNAVAILABLE" and refused.value.from_server
    assert "shutting down" in refused.value.message
    assert counts == [MAX_TOKENS] * NUM_STREAMS and reasons == ["length"] * NUM_STREAMS
    assert f"drained {NUM_STREAMS} requests in flight (0 cut at the timeout)" in output
    assert serve.returncode == 0
    assert wait_for(lambda: not any(map(_alive, started)), 60)
    print(
        f"\nSIGTERM with {NUM_STREAMS} streams of {MAX_TOKENS} tokens: NOT_SERVING after "
        f"{not_serving_s:.1f}s, streams done after {streams_done_s:.1f}s, "
        f"exit after {exited_s:.1f}s"
    )


def _auth_mode(pid: int) -> str:
    """RAY_AUTH_MODE in the environment of process `pid`."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        entries = environ.read().split(b"\0")
    variables = dict(entry.split(b"=", 1) for entry in entries if b"=" in entry)
    return variables.get(b"RAY_AUTH_MODE", b"").decode()


def _drain_output(process: subprocess.Popen, timeout_s: float) -> str:
    """The rest of the process's output once it exits (read in a thread: it may be long)."""
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.append(process.stdout.read()))
    reader.start()
    process.wait(timeout=timeout_s)
    reader.join(timeout=30)
    return "".join(chunks)
