"""A real gRPC server and a real OpenAI HTTP server over one LocalBackend, on their own
event-loop thread (the API without a cluster, for the checks that need no routing)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from halfmoon.cluster.frontend.grpc_server import start_grpc_server
from halfmoon.cluster.frontend.http_server import OpenAIServer, start_http_server
from halfmoon.cluster.serving.local_backend import LocalBackend
from halfmoon.engine import EngineConfig, LLMEngine
from halfmoon.engine.async_engine import AsyncEngine


@dataclass
class RunningApi:
    grpc_address: str
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str
    loop: asyncio.AbstractEventLoop  # the servers' loop: run coroutines on it (e.g. a drain)


@contextmanager
def serve_openai(
    model_dir, api_key: str | None = None, limits=None, drain=None, http_limits=None
) -> Iterator[RunningApi]:
    """Serve the checkpoint over gRPC and HTTP on free loopback ports until the block exits
    (`http_limits`: the server's HttpLimits, else the defaults)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="api-servers", daemon=True)
    thread.start()
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_pages=128)))
    backend = LocalBackend(engine)

    async def start():
        grpc_server, grpc_port = await start_grpc_server(backend, port=0, api_key=api_key)
        model = await backend.model_info()
        api = OpenAIServer(backend, engine.engine.tokenizer, model, None, api_key, limits, drain)
        http_server, http_port = await start_http_server(api.app, port=0, limits=http_limits)
        return grpc_server, grpc_port, http_server, http_port, model.model

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    grpc_server, grpc_port, http_server, http_port, model = run(start())
    try:
        yield RunningApi(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/v1", model, loop)
    finally:
        run(http_server.stop())
        run(grpc_server.stop(None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        engine.shutdown()
