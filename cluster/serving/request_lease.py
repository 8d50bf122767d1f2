"""One request's hold on the cluster: its router record, its place in the Conductor and what
its attempt holds on the workers (decode pages, prefill job, store leases), given back once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from halfmoon.cluster.serving.cluster_backend import RequestTrace, Worker


@dataclass(slots=True)
class Attempt:
    """One try at serving a request: the workers it asked and the calls it sent them.

    `ticket` names the try's worker calls, so an abort that overtakes its call still ends it.
    """

    ticket: str = field(default_factory=lambda: uuid.uuid4().hex)
    prefill: Worker | None = None
    decode: Worker | None = None
    reserve: object | None = None  # the decode reserve's ObjectRef, once sent
    stored: object | None = None  # the prefill's `stored` call: its KV is all in the store
    ended: bool = False  # the workers ended it themselves: nothing to abort

    def workers(self) -> list[Worker]:
        return [w for w in (self.prefill, self.decode) if w is not None]


class RequestLease:
    """Owns everything one request holds; `close` gives it all back exactly once.

    The release runs as its own task behind `asyncio.shield`, so a second cancel (a deadline
    after a client cancel, say) ends the wait for it but never the release itself.
    """

    def __init__(self, request_id: str, trace: RequestTrace) -> None:
        self.request_id = request_id
        self.trace = trace
        self.attempt = Attempt()
        self.num_attempts = 1
        self.early_sent = False  # the prefill's first token reached the client
        self.streamed = False  # decode output reached the client: a retry would repeat it
        self.aborted = False  # the client asked to abort (the Abort call)
        self._release: asyncio.Future | None = None

    def retry(self) -> Attempt:
        """A fresh attempt after the current one was given up."""
        self.attempt = Attempt()
        self.num_attempts += 1
        return self.attempt

    @property
    def releasing(self) -> asyncio.Future | None:
        """The release under way (or done); None before `close`."""
        return self._release

    async def close(self, release: Callable[[RequestLease], Awaitable[None]]) -> None:
        """Run `release(self)` once however often this is called; wait for it unless cancelled."""
        if self._release is None:
            self._release = asyncio.ensure_future(release(self))
        await asyncio.shield(self._release)
