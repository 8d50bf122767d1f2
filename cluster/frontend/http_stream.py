"""One request's backend stream relayed to an HTTP client: collected whole, or sent as
server-sent events, cancelled when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse

from halfmoon.cluster.frontend.drain import Drain
from halfmoon.cluster.frontend.http_errors import http_error
from halfmoon.cluster.frontend.http_request import ClientGone
from halfmoon.cluster.frontend.openai_responses import ResponseShape
from halfmoon.cluster.serving.backend import Backend, GenerateInput, TokenDelta

END = object()


class Relay:
    """Runs one request's backend stream in a task of its own, so a client that goes away
    cancels it exactly once and the backend's clean-up (abort on every worker) runs to the end."""

    def __init__(self, backend: Backend, request: GenerateInput, drain: Drain) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(backend.generate(request), drain))

    async def _pump(self, deltas: AsyncIterator[TokenDelta], drain: Drain) -> None:
        try:
            with drain.track():  # a drain for shutdown waits for this stream
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        self.queue.put_nowait(delta)
        except Exception as error:  # noqa: BLE001 - handed to the reader, who maps it
            self.queue.put_nowait(error)
        finally:
            self.queue.put_nowait(END)

    async def next(self) -> TokenDelta | None:
        """The next delta; None at the end; the backend's error is raised here."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is END else item

    async def collect(self) -> list[TokenDelta]:
        deltas = []
        while (delta := await self.next()) is not None:
            deltas.append(delta)
        return deltas

    def cancel(self) -> None:
        self.task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events; closes its generator however the response ends (a disconnect
    cancels the sending task while the generator waits at a `yield`)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def sse_events(relay: Relay, delta: TokenDelta | None, shape: ResponseShape):
    """The SSE body: one `data:` line per chunk, an error object if the stream fails, [DONE]."""
    try:
        usage = None
        for opening in shape.first_chunks(delta):
            yield _event(opening)
        while delta is not None:
            for chunk in shape.chunks(delta):
                yield _event(chunk)
            usage = delta.usage or usage
            delta = await relay.next()
        if shape.include_usage and usage is not None:
            yield _event(shape.usage_chunk(usage))
    except Exception as error:  # noqa: BLE001 - the status is sent; the error goes in-stream
        yield _event(http_error(error)[1])
    finally:
        relay.cancel()  # a no-op once the stream ended; else the request is aborted
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def unless_client_gone(request: Request, relay: Relay, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel the request and raise ClientGone."""
    work_task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work_task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work_task.done():
        work_task.cancel()
        relay.cancel()
        raise ClientGone
    return work_task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
