"""An `LLMEngine` stepped by a background thread, streamed to asyncio callers.

The workers are async Ray actors: their event loop keeps serving calls (and moving KV)
while this thread runs the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch

from halfmoon.engine.errors import (
    DeviceFailedError,
    HalfmoonError,
    RequestNotFoundError,
    is_device_failure,
)
from halfmoon.engine.llm_engine import LLMEngine, RequestOutput, StepTiming
from halfmoon.engine.openmp_pool import release_thread_pool
from halfmoon.engine.outputs import EngineStats
from halfmoon.engine.published import Published
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.streams import Streams
from halfmoon.engine.tokenizer import Prompt

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_TIDY_S = 0.5  # how often an idle step loop applies what a step would (pages given back)


class EngineFailure(HalfmoonError):
    """The engine's step failed; the requests in flight were ended."""


class AsyncEngine:
    """Thread-safe front of an `LLMEngine`: add, reserve, join, abort, stream outputs; its
    stats, step timings and page events read without waiting for a step."""

    def __init__(self, engine: LLMEngine) -> None:
        """Steps `engine` on a thread of its own; the calling thread (which may have built it)
        gives back its OpenMP threads, so the step thread's are the only ones (openmp_pool)."""
        self.engine = engine
        release_thread_pool()
        self._lock = threading.Lock()  # the engine's: held by the step thread for each step
        # Requests added, joined and aborted from the event loop go through this inbox and
        # are applied by the step thread between steps, all of them at once and in order:
        # the loop never waits for a step (taking the engine's lock there stalled a prefill
        # worker's loop for 5-6 s at saturation, when the step thread took it back first).
        self._inbox: deque[Callable[[], None]] = deque()
        self._inbox_ready = threading.Condition(threading.Lock())
        self._streams = Streams()
        # The step thread's results of inbox calls, by the loop that awaits them (`_settle_all`).
        self._settled: dict[asyncio.AbstractEventLoop, list] = {}
        self._stopped = False
        # Set once a step failed with an error the device keeps: nothing is taken after it.
        self.failed: DeviceFailedError | None = None
        self._published = Published(engine)  # for readers that must not wait for a step
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` between steps and return its result, waiting for the step in
        progress: for threads that may wait (tests, set-up); on the event loop use `run`."""
        with self._lock:
            try:
                return fn(self.engine)
            finally:
                release_thread_pool()
                self._published.publish(self.engine)

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` on the step thread before its next step; the event loop goes on."""
        return await self._on_step_thread(lambda: fn(self.engine))

    async def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *args,
        **kwargs,
    ) -> str:
        """Queue a request (the arguments of `LLMEngine.add_request`) and return its id, or
        raise its `InvalidRequestError`; its outputs go to `stream(request_id)`."""

        def add() -> tuple[str, str]:
            added = self.engine.add_request(prompt, params, request_id, *args, **kwargs)
            return added, added

        return await self._open(request_id, add)

    async def reserve(
        self, prompt: Prompt, params: SamplingParams, request_id: str, *args, **kwargs
    ) -> tuple[list[int], object | None]:
        """Hold pages for a prompt whose KV arrives from outside (`LLMEngine.reserve`): the
        pages, and the fence to write into them after (`PagedKvCache.mark()`, None on CPU),
        recorded on the step thread as soon as they are reserved: every step that read them
        before is queued ahead of it, and none queued since waits for it."""

        def reserve() -> tuple[str, tuple[list[int], object | None]]:
            pages = self.engine.reserve(prompt, params, request_id, *args, **kwargs)
            return request_id, (pages, self.engine.kv_cache.mark())

        return await self._open(request_id, reserve)

    async def join(self, request_id: str, first_token_ids: int | list[int]) -> None:
        """Start decoding a reserved request after its first token (one per sequence when
        `n` > 1); outputs (the first tokens' too) go to its stream."""

        def join() -> None:
            for out in self.engine.join(request_id, first_token_ids):
                self._streams.deliver(out)

        await self._on_step_thread(join)

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is, before the next step; its stream ends with finish
        reason `abort`. True when it was streaming here (without waiting to know more)."""
        self._post(lambda: self._abort_now(request_id))
        return request_id in self._streams

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; aborts it if the consumer goes away."""
        queue = self._streams.queue(request_id)
        if queue is None:
            raise RequestNotFoundError(request_id)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            # Only its own: a retry of the request on this worker may hold the id by now.
            if self._streams.close(request_id, queue) and not finished:
                self.abort(request_id)

    async def generate(self, *args, **kwargs) -> AsyncIterator[RequestOutput]:
        """Add a request (the arguments of `LLMEngine.add_request`) and stream its outputs."""
        request_id = await self.add_request(*args, **kwargs)
        async with contextlib.aclosing(self.stream(request_id)) as outputs:
            async for out in outputs:
                yield out

    def stats(self) -> tuple[EngineStats, float]:
        """The engine's stats as of the end of its last step or call, and how many seconds ago
        that was; never waits for the step in progress."""
        return self._published.stats()

    def take_steps(self) -> list[StepTiming]:
        """The steps that ended since the last call: what each computed, how long it took."""
        return self._published.take_steps()

    def take_page_events(self) -> list[tuple[str, bytes]]:
        """(`stored` or `evicted`, block key) of the blocks that entered or left the engine's
        pages since the last call (`LLMEngine.take_page_events`), without waiting for a step."""
        return self._published.take_page_events()

    @property
    def running(self) -> bool:
        """True while the step thread runs (until `shutdown`)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        with self._inbox_ready:
            self._stopped = True
            self._inbox_ready.notify()
        self._thread.join(timeout=10)

    def _post(self, command: Callable[[], None]) -> None:
        """Have the step thread run `command` (under the engine's lock) before its next step."""
        with self._inbox_ready:
            self._inbox.append(command)
            self._inbox_ready.notify()

    async def _open(self, request_id: str | None, fn: Callable[[], tuple[str, T]]) -> T:
        """Run `fn` (which adds a request to the engine: its id and a result) on the step
        thread and open the request's stream there, before any step can output to it; a
        caller that gives up meanwhile has the request aborted and its stream dropped (else it
        would run for no one)."""
        stream = (asyncio.get_running_loop(), asyncio.Queue())

        def opened() -> T:
            self.check()  # a failed device takes nothing more
            added, result = fn()
            self._streams.open(added, stream)
            return result

        try:
            return await self._on_step_thread(opened)
        except asyncio.CancelledError:
            if request_id is not None:

                def drop() -> None:
                    self._abort_now(request_id)
                    self._streams.close(request_id)

                self._post(drop)
            raise

    def _abort_now(self, request_id: str) -> None:
        """Step thread: end the request if the engine has it; its last outputs to its stream."""
        if request_id in self.engine.requests:
            for out in self.engine.abort(request_id):
                self._streams.deliver(out)

    async def _on_step_thread(self, fn: Callable[[], T]) -> T:
        """`fn()`'s result (or exception), run by the step thread between steps."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            try:
                result, error = fn(), None
            except Exception as raised:  # noqa: BLE001 - handed to the caller
                result, error = None, raised
            self._settled.setdefault(loop, []).append((done, result, error))

        self._post(command)
        return await done

    def _settle_all(self) -> None:
        """Step thread: the results of the calls it ran, in one wake-up of each event loop."""
        for loop, settled in self._settled.items():
            loop.call_soon_threadsafe(_settle_each, settled)
        self._settled.clear()

    def _loop(self) -> None:
        # OpenMP's team size is a per-thread setting: this thread starts with the library's
        # default (every core), not what `torch.set_num_threads` set for the process.
        torch.set_num_threads(torch.get_num_threads())
        busy = False
        while (commands := self._take_commands(busy)) is not None:
            busy = self._run(commands)

    def _take_commands(self, busy: bool) -> list[Callable[[], None]] | None:
        """The commands posted since the last call, once there is one (or `IDLE_TIDY_S` has
        passed) unless `busy`; None once `shutdown` was called."""
        with self._inbox_ready:
            if not (busy or self._inbox or self._stopped):
                self._inbox_ready.wait(IDLE_TIDY_S)
            commands = list(self._inbox)
            self._inbox.clear()
            return None if self._stopped else commands

    def _run(self, commands: list[Callable[[], None]]) -> bool:
        """Under the engine's lock, `commands` and then a step, or what a step would apply
        when there is no work; returns whether there was (the loop then goes on at once)."""
        with self._lock:
            for command in commands:
                command()
            self._settle_all()
            if not self.engine.has_unfinished_requests():
                self.engine.tidy()  # pages given back while idle
                self._published.publish(self.engine)
                return False
            began = time.time()
            outputs = self._step()
            self._published.publish(self.engine)
        timeline = (("engine step began", began), ("engine step ended", time.time()))
        for out in outputs:
            out.timeline = timeline
        self._streams.deliver_step(outputs)
        return True

    def check(self) -> None:
        """Raise the `DeviceFailedError` once a step has left the device unusable (the
        worker's health check: its controller then replaces it)."""
        if self.failed is not None:
            raise self.failed

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as error:  # noqa: BLE001 - a failed step must not kill serving
            fatal = is_device_failure(error)
            if fatal:  # before the requests' streams end: their callers may ask at once
                self.failed = DeviceFailedError(f"the engine's device failed in a step: {error}")
            end_failed_step(self.engine, self._streams, error, fatal)
            return []


def end_failed_step(engine: LLMEngine, streams: Streams, error: Exception, fatal: bool) -> None:
    """A step raised `error`: every request in flight ends with an EngineFailure on its
    stream; `fatal`: it left the device unusable (`is_device_failure`: the engine then takes
    nothing more)."""
    log.exception(
        "engine step failed%s; ending the requests in flight",
        " on its device, taking no more requests" if fatal else "",
    )
    for request_id in list(engine.requests):
        engine.abort(request_id)
        streams.deliver(EngineFailure(f"request {request_id} failed: {error}"), request_id)


def _settle_each(settled: list[tuple[asyncio.Future, object, Exception | None]]) -> None:
    for future, result, error in settled:
        if future.done():  # its caller was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
