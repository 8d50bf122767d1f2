"""One request on the router side, from `generate` to its release: its tokens and block keys
(hashed once), the Conductor's decision, the attempt under way, its timings, and what it holds
on the workers (decode pages, prefill job, store leases), given back once."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.router.decision import Decision
from halfmoon.router.request import RouteRequest

if TYPE_CHECKING:
    from halfmoon.cluster.serving.workers import Worker


MAX_ATTEMPTS = 3  # tries per request when the workers it was sent to die before any output
MAX_MIGRATIONS = 2  # moves of a request whose workers die after some output was streamed


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


@dataclass(slots=True, eq=False)
class Request:
    """Everything the router knows and holds for one request; `close` gives what it holds
    back exactly once.

    The release runs as its own task behind `asyncio.shield`, so a second cancel (a deadline
    after a client cancel, say) ends the wait for it but never the release itself.
    """

    request_id: str
    params: SamplingParams
    trace: RequestTrace
    token_ids: list[int] = field(default_factory=list)  # the prompt (and, migrated, the output)
    block_keys: list[bytes] = field(default_factory=list)  # hashed once, for every attempt
    route: RouteRequest | None = None  # what the Conductor places (the same keys)
    decision: Decision | None = None
    attempt: Attempt = field(default_factory=Attempt)
    num_attempts: int = 1
    asked: SamplingParams | None = None  # the client's, as checked (`params`: this attempt's)
    num_prompt_tokens: int = 0  # of the client's prompt, however often it was migrated
    output_ids: list[int] = field(default_factory=list)  # streamed to the client so far
    num_migrations: int = 0
    early_sent: bool = False  # the prefill's first token reached the client
    streamed: bool = False  # decode output reached the client: a retry would repeat it
    aborted: bool = False  # the client asked to abort (the Abort call)
    finished: bool = False  # released: kept only for `explain` and `timeline`
    releasing: asyncio.Future | None = None  # the release under way (or done)

    def retry(self) -> Attempt:
        """A fresh attempt after the current one was given up."""
        self.attempt = Attempt()
        self.num_attempts += 1
        return self.attempt

    @property
    def num_prior_output_tokens(self) -> int:
        """Of this attempt's prompt, the tokens earlier attempts generated (after a migration)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def tokens_left(self) -> int:
        """Output tokens the client may still get."""
        return self.asked.max_tokens - len(self.output_ids)

    def recovery(self) -> str | None:
        """How to go on after its worker died: "finish" (every token is out already), "retry"
        (nothing streamed yet), "migrate" (output streamed), or None (out of tries)."""
        if self.streamed and self.tokens_left <= 0:
            return "finish"
        if not self.streamed:
            return "retry" if self.num_attempts < MAX_ATTEMPTS else None
        return "migrate" if self.num_migrations < MAX_MIGRATIONS else None

    def migrate(self) -> Attempt:
        """A fresh attempt that continues from what the client already has: the prompt is the
        client's followed by the output so far, with the tokens left to generate."""
        self.token_ids = self.token_ids[: self.num_prompt_tokens] + self.output_ids
        self.params = dataclasses.replace(self.asked, max_tokens=self.tokens_left)
        self.early_sent = False
        self.num_migrations += 1
        return self.retry()

    async def close(self, release: Callable[[Request], Awaitable[None]]) -> None:
        """Run `release(self)` once however often this is called; wait for it unless cancelled."""
        if self.releasing is None:
            self.releasing = asyncio.ensure_future(release(self))
        await asyncio.shield(self.releasing)
