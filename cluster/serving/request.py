"""One request on the router side, from `generate` to its release: its tokens and block keys
(hashed once), its phase, the Conductor's decision, the attempt under way, what it holds on the
workers (decode pages, prefill job, store leases, given back once) and its timings. Its methods
are the request's state changes and the only writers of its trace (telemetry, never read back
to decide anything)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.router.decision import Decision
from halfmoon.router.request import RouteRequest

if TYPE_CHECKING:
    from halfmoon.cluster.serving.workers import Worker
    from halfmoon.prefill_worker.task import PrefillResult


MAX_ATTEMPTS = 3  # tries per request when the workers it was sent to die before any output
MAX_MIGRATIONS = 2  # moves of a request whose workers die after some output was streamed
Phase = Literal[
    "queued", "routed", "prefilling", "handed_off", "decoding", "retrying", "migrating", "done"
]


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
    phase: Phase = "queued"
    decision: Decision | None = None
    attempt: Attempt = field(default_factory=Attempt)
    num_attempts: int = 1
    asked: SamplingParams | None = None  # the client's, as checked (`params`: this attempt's)
    num_prompt_tokens: int = 0  # of the client's prompt, however often it was migrated
    output_ids: list[int] = field(default_factory=list)  # streamed to the client so far
    num_migrations: int = 0
    # The prefill's first token and its logprobs (one pair per sequence when n > 1), streamed
    # before the decode worker's output; a retry continues from them.
    first_tokens: list[tuple] | None = None
    early_sent: bool = False  # the prefill's first token reached the client
    streamed: bool = False  # decode output reached the client: a retry would repeat it
    aborted: bool = False  # the client asked to abort (the Abort call)
    finished: bool = False  # released: kept only for `explain` and `timeline`
    releasing: asyncio.Future | None = None  # the release under way (or done)

    @property
    def prefills_where_it_decodes(self) -> bool:
        """Colocated, or a short prompt the router sent straight to the decode worker."""
        return self.attempt.prefill is None

    def routed(self, decision: Decision) -> None:
        self.decision, self.phase = decision, "routed"
        self.trace.mark("routed")
        self.trace.predicted_ttft_s = decision.predicted_ttft_s
        self.trace.predicted_queue_s = decision.predicted_queue_s

    def sent(self, prefill: Worker | None, decode: Worker) -> None:
        """The attempt's workers: `prefill` None when `decode` prefills it too."""
        self.attempt.prefill, self.attempt.decode = prefill, decode
        self.trace.prefill_instance = None if prefill is None else prefill.name
        self.trace.decode_instance = decode.name
        self.phase = "prefilling"

    def started(self, now: float) -> None:
        """Its prefill began: sent to the prefill worker, or to the one worker colocated."""
        self.trace.prefill_started_s = now
        if self.prefills_where_it_decodes:
            self.trace.mark("sent to the worker", now)

    def note(self, stage: str) -> None:
        """`stage` was reached now, for its timeline (`halfmoon status --explain`)."""
        self.trace.mark(stage)

    def prompt(self, token_ids: list[int]) -> None:
        """The client's prompt, tokenized and checked, with the sampling it asked for."""
        self.token_ids, self.asked, self.num_prompt_tokens = token_ids, self.params, len(token_ids)
        self.trace.num_prompt_tokens = len(token_ids)

    def prefilled(self, result: PrefillResult, now: float) -> None:
        """The prefill call returned: where its time went, its first tokens, its cache use."""
        trace = self.trace
        trace.mark("prefill returned", now)
        for stage, wall_s in result.stages():
            trace.mark_wall(stage, wall_s)
        trace.prefill_compute_s = result.computed_at - result.started_at
        trace.prefill_returned_s = now
        trace.worker_tail_s = result.finished_at - result.computed_at
        trace.num_loaded_tokens = result.num_loaded_tokens
        trace.loaded_from = result.loaded_from
        trace.num_cached_tokens = result.num_local_cached_tokens + result.num_loaded_tokens
        if self.first_tokens is None:  # a retry continues from the first tokens already out
            self.first_tokens = result.first_tokens
        self.phase = "handed_off"

    def emitted(self, token_ids: list[int], now: float) -> bool:
        """Tokens went to the client; True when they hold its first token."""
        self.output_ids += token_ids
        self.trace.num_output_tokens += len(token_ids)
        first = self.trace.first_token_s is None and bool(token_ids)
        if first:
            self.trace.first_token_s = now
            self.trace.mark("first token out", now)
        self.trace.last_token_s = now
        return first

    def relayed(self, out, token_ids: list[int], now: float) -> bool:
        """One output of the worker's stream (`out`, a RequestOutput) went to the client with
        `token_ids` of it; True when they hold its first token."""
        if out.timeline and not self.streamed:
            role = "worker" if self.prefills_where_it_decodes else "decode worker"
            for stage, wall_s in out.timeline:
                self.trace.mark_wall(f"{role}: {stage}", wall_s)
        first = self.emitted(token_ids, now)
        if out.finished:  # the worker ended it: nothing is left to abort there
            self.attempt.ended = True
            self.end("cancelled" if out.finish_reason == "abort" else "finished")
            if self.prefills_where_it_decodes:
                self.trace.num_cached_tokens = out.num_cached_tokens
        if not first and not self.streamed:
            self.trace.mark("first decode output")
        self.streamed, self.phase = True, "decoding"
        return first

    def end(self, outcome: str, reason: str = "") -> None:
        """How the request ended, for the metrics: finished, cancelled, rejected, ..."""
        self.trace.outcome, self.trace.reason = outcome, reason

    def released(self) -> None:
        self.phase = "done"
        self.trace.mark("released")

    def retry(self) -> Attempt:
        """A fresh attempt after the current one was given up."""
        self.attempt = Attempt()
        self.num_attempts += 1
        self.phase = "retrying"
        self.trace.prefill_instance = self.trace.decode_instance = None
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
        self.early_sent, self.first_tokens = False, None
        self.num_migrations += 1
        self.trace.mark(f"migrated after {len(self.output_ids)} output tokens")
        attempt = self.retry()
        self.phase = "migrating"
        return attempt

    async def close(self, release: Callable[[Request], Awaitable[None]]) -> None:
        """Run `release(self)` once however often this is called; wait for it unless cancelled."""
        if self.releasing is None:
            self.releasing = asyncio.ensure_future(release(self))
        await asyncio.shield(self.releasing)
