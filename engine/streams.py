"""Each streaming request's queue on the event loop that reads it, filled from the step thread."""

from __future__ import annotations

import asyncio

from halfmoon.engine.outputs import RequestOutput

Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class Streams:
    """The open streams by request id; the step thread delivers outputs (or the error that
    ends them) to their loops, which read them (`AsyncEngine.stream`)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, request_id: str, stream: Stream) -> None:
        self._by_id[request_id] = stream

    def queue(self, request_id: str) -> asyncio.Queue | None:
        """The queue `request_id`'s outputs arrive in, or None: no stream is open for it."""
        stream = self._by_id.get(request_id)
        return None if stream is None else stream[1]

    def close(self, request_id: str, queue: asyncio.Queue | None = None) -> bool:
        """Close `request_id`'s stream (only if it still delivers to `queue`, when given: a
        later request under the same id may have opened its own); whether it did."""
        stream = self._by_id.get(request_id)
        if stream is None or (queue is not None and stream[1] is not queue):
            return False
        del self._by_id[request_id]
        return True

    def deliver(self, item: RequestOutput | BaseException, request_id: str | None = None) -> None:
        """One output (or an error, for `request_id`) to its stream, if it is open."""
        stream = self._by_id.get(request_id or item.request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, in one wake-up of each event loop: one `call_soon_threadsafe` per
        output cost ~5 us of this thread each (a write to the loop's wake-up pipe), 0.3 ms a
        step at batch 64."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._by_id.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
