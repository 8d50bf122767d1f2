"""Graceful shutdown of a frontend: refuse new requests, let the streams in flight finish."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from halfmoon.cluster.serving.backend import NoWorkerError

log = logging.getLogger(__name__)


class ShuttingDownError(NoWorkerError):
    """The server is draining for shutdown and takes no new requests: UNAVAILABLE.
    `retry_after_s`: until the drain ends (the HTTP API's Retry-After)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Drain:
    """Counts the requests in flight; `drain` refuses new ones and waits for those to end."""

    def __init__(self) -> None:
        self.draining = False
        self.ends_at = 0.0  # time.monotonic() at which a drain stops waiting
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_drain: list[Callable[[], Awaitable[None]]] = []

    def on_drain(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` when draining starts (e.g. health turns NOT_SERVING)."""
        self._on_drain.append(callback)

    def check_open(self) -> None:
        """Raise `ShuttingDownError` while draining."""
        if self.draining:
            raise ShuttingDownError(
                "the server is shutting down; send the request elsewhere", self.seconds_left()
            )

    def seconds_left(self) -> int:
        """Whole seconds until the drain stops waiting, at least 1."""
        return max(1, math.ceil(self.ends_at - time.monotonic()))

    @contextmanager
    def track(self) -> Iterator[None]:
        """One request in flight for the block (call `check_open` first)."""
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait up to `timeout_s` for the rest; returns those left."""
        self.draining = True
        self.ends_at = time.monotonic() + timeout_s
        for callback in self._on_drain:
            await callback()
        log.info("draining: %d requests in flight, waiting up to %.0f s", self.active, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            log.warning("drain timeout: cutting %d requests still in flight", self.active)
        return self.active
