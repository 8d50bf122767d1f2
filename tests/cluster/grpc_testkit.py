"""A real gRPC server over a real LocalBackend, run on its own event-loop thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from halfmoon.cluster.frontend.grpc_server import start_grpc_server
from halfmoon.cluster.serving.local_backend import LocalBackend
from halfmoon.engine import EngineConfig, LLMEngine
from halfmoon.engine.async_engine import AsyncEngine


@dataclass
class RunningServer:
    address: str
    engine: AsyncEngine
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine):
        """Run `coroutine` on the server's event loop; returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def num_used_pages(self) -> int:
        return self.engine.call(lambda engine: engine.pool.num_used_pages)

    def num_generated_tokens(self) -> int:
        return self.engine.call(lambda engine: engine.stats().num_generated_tokens)

    def num_requests(self) -> int:
        return self.engine.call(lambda engine: len(engine.requests))

    def wait_until_idle(self, timeout_s: float = 10.0) -> int:
        """Pages still used once no request is left (or at the timeout); idle is 0."""
        return wait_for(lambda: self.num_requests() == 0 and self.num_used_pages() == 0, timeout_s)


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll a condition the test cannot await (it changes in the server's threads)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextmanager
def serve_model(model_dir, num_pages: int = 128, **options) -> Iterator[RunningServer]:
    """Serve the checkpoint in `model_dir` on a free loopback port until the block exits;
    `options` go to `start_grpc_server` (limits, drain, tls)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-server", daemon=True)
    thread.start()
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_pages=num_pages)))
    start = start_grpc_server(LocalBackend(engine), port=0, **options)
    server, port = asyncio.run_coroutine_threadsafe(start, loop).result()
    try:
        yield RunningServer(f"127.0.0.1:{port}", engine, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        engine.shutdown()
