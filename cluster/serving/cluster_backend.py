"""The cluster's `Backend`: each request goes through the Conductor to a prefill and a decode
worker, and the decode worker's token stream is relayed back to the client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from halfmoon.cluster.serving.attempt import Dispatcher
from halfmoon.cluster.serving.backend import (
    GenerateInput,
    RejectedError,
    TokenDelta,
    Usage,
    WorkerDiedError,
    delta_from_output,
)
from halfmoon.cluster.serving.backend_views import BackendViews
from halfmoon.cluster.serving.clients import StoreClient
from halfmoon.cluster.serving.prompts import PromptTokenizer
from halfmoon.cluster.serving.registry import RequestRegistry, check_queue
from halfmoon.cluster.serving.request import Request
from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.cluster.serving.workers import PollReport, Worker, WorkerPool
from halfmoon.cluster.worker.errors import WorkerCallError
from halfmoon.cluster.worker.info import WorkerInfo
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.llm_engine import RequestOutput
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.kvstore.keys import block_keys
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import RouterConfig
from halfmoon.router.events import Abandoned, DecodeJoined, Finished, FirstToken, PrefillDone
from halfmoon.router.profile import Profile
from halfmoon.router.request import RouteRequest

log = logging.getLogger(__name__)

Observer = Callable[[RequestTrace], None]


class ClusterBackend(BackendViews):
    """Routes with the Conductor (disaggregated) or least-loaded (colocated) and relays tokens."""

    def __init__(
        self,
        tokenizer,
        info: WorkerInfo,
        router: RouterConfig,
        profile: Profile,
        mode: str,
        model_name: str | None = None,
        max_queued_per_worker: int | None = None,
        *,
        pool_wait_s: float,
    ):
        self.info = info
        self.model_name = model_name or info.model
        self.conductor = Conductor(router, profile, colocated=mode == "colocated")
        self.prompts = PromptTokenizer(tokenizer, info.vocab_size, info.max_model_len)
        self.pool = WorkerPool(self.conductor, mode)
        self.requests = RequestRegistry()
        self.dispatch = Dispatcher(self.pool, self.requests, self.conductor, pool_wait_s)
        self.max_queued_per_worker = max_queued_per_worker
        self.observer: Observer | None = None

    def set_observer(self, observer: Observer | None) -> Observer | None:
        """Call `observer` with each ended request's trace; returns the one it replaces."""
        previous, self.observer = self.observer, observer
        return previous

    def add_worker(self, worker: Worker, blocks: Sequence[BlockEvent] = ()) -> None:
        """Route to `worker`; `blocks`: what its pages hold already (its snapshot)."""
        self.pool.add(worker, blocks)

    def remove_worker(self, name: str) -> Worker | None:
        """Forget worker `name`; returns it (None if unknown)."""
        return self.pool.remove(name)

    def set_draining(self, name: str, draining: bool) -> None:
        """A draining worker gets no new requests; the ones it has finish."""
        self.pool.set_draining(name, draining)

    def add_store(self, name: str, store: StoreClient, blocks: Sequence[BlockEvent] = ()) -> None:
        self.pool.add_store(name, store, blocks)

    def remove_store(self, name: str) -> None:
        self.pool.remove_store(name)

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        req = Request(request.request_id, request.params, RequestTrace(time.monotonic()))
        self.requests.add(req)  # checked before anything is taken: the first one goes on
        try:
            self._check_queue(req.request_id)
            await self._prepare(req, request)
            async for delta in self._serve(req):
                delta.num_prompt_tokens = req.num_prompt_tokens  # the worker's has any migration's
                yield delta
        except (GeneratorExit, asyncio.CancelledError):
            req.end("cancelled")
            raise
        except InvalidRequestError:
            req.end("invalid")
            raise
        except RejectedError as error:
            req.end("rejected", _reason_kind(str(error)))
            raise
        finally:
            await req.close(self._release)

    async def _prepare(self, req: Request, request: GenerateInput) -> None:
        """Tokenize, check the request fits the context, and hash its block keys (once)."""
        token_ids = await self.prompts.tokenize(request.prompt)
        req.note("tokenized")
        info = self.info
        if request.to_context_end:
            left = max(info.max_model_len - len(token_ids), 1)
            req.params = request.params = dataclasses.replace(request.params, max_tokens=left)
        self.prompts.check_fits(len(token_ids), req.params.max_tokens)
        req.prompt(token_ids)
        req.route = RouteRequest(
            req.request_id,
            [],
            0,
            0,
            req.trace.arrived_s,
            ttft_slo_s=request.ttft_slo_s,
            tbt_slo_s=request.tbt_slo_s,
        )
        self._key(req)

    def _key(self, req: Request) -> None:
        """Hash the request's block keys (once per prompt: a migration's prompt is longer) and
        size what the Conductor places."""
        info, token_ids = self.info, req.token_ids
        req.block_keys = block_keys(info.root_key, token_ids, info.block_size)
        # The engine stops at the context length, so no sequence holds KV beyond it. Each of
        # the request's `n` holds its own output's KV beside the one prompt, up to a decode
        # worker's pages (beyond them its engine preempts instead).
        per_sequence = min(req.params.max_tokens, info.max_model_len - len(token_ids))
        max_output_tokens = min(
            req.params.n * per_sequence, info.num_pages * info.block_size - len(token_ids)
        )
        req.route = dataclasses.replace(
            req.route,
            block_keys=req.block_keys,
            num_prompt_tokens=len(token_ids),
            max_output_tokens=max_output_tokens,
        )

    async def _serve(self, req: Request) -> AsyncIterator[TokenDelta]:
        """Serve the request, moving it to other workers when one dies (or its KV never
        arrives): retried while it had streamed nothing (beyond the prefill's first token,
        which the next decode worker continues from), migrated once it had."""
        while True:
            try:
                async for delta in self._attempt(req):
                    yield delta
                return
            except WorkerCallError as error:
                if req.aborted:
                    yield _aborted_delta(req)
                    return
                if not error.retryable or not await self._recover(req, error):
                    raise
            except WorkerDiedError as error:
                if req.aborted or not await self._recover(req, error):
                    raise
            if req.streamed and req.tokens_left <= 0:  # died after the last token was out
                yield _finished_delta(req)
                return

    async def _recover(self, req: Request, why: Exception) -> bool:
        """Start a fresh attempt on other workers; False when the request is out of them."""
        if req.streamed and req.params.n > 1:
            raise WorkerDiedError(
                f"request {req.request_id} lost a worker after its output began: a request "
                f"with n > 1 (n = {req.params.n}) is not migrated; send it again"
            ) from why
        way = req.recovery()
        if way == "retry":
            await self._retry(req, why)
        elif way == "migrate":
            await self._migrate(req, why)
        return way is not None

    async def _migrate(self, req: Request, why: Exception) -> None:
        """Continue a request that streamed output on other workers: its prompt and the tokens
        the client has are prefilled again (from the store's cached blocks where they are)."""
        log.warning(
            "migrating request %s after %d output tokens: %s",
            req.request_id,
            len(req.output_ids),
            why,
        )
        await self.dispatch.end(req)
        self.conductor.on_event(Abandoned(req.request_id, time.monotonic()))
        req.migrate()
        if req.tokens_left > 0:
            self._key(req)

    async def _retry(self, req: Request, why: Exception) -> None:
        """Give up the current attempt and start a fresh one on other workers."""
        log.warning("retrying request %s on other workers: %s", req.request_id, why)
        await self.dispatch.end(req)
        self.conductor.on_event(Abandoned(req.request_id, time.monotonic()))
        req.retry()

    async def _attempt(self, req: Request) -> AsyncIterator[TokenDelta]:
        worker, stream = await self.dispatch.start(req)
        early = req.first_tokens or []
        if early and not req.early_sent:  # out now, not after the hand-off
            req.early_sent = True
            for index, (token_id, logprobs) in enumerate(early):
                if req.emitted([token_id], time.monotonic()):
                    self._first_token_out(req)
                yield TokenDelta(
                    [token_id], "", logprobs=[logprobs] if logprobs else [], index=index
                )
        # Each sequence's first output repeats its first token, streamed already.
        repeated = {index: token_id for index, (token_id, _) in enumerate(early)}
        async for out in self.dispatch.outputs(worker, stream, req.attempt):
            new_ids = out.new_token_ids
            if out.index in repeated and new_ids[:1] == [repeated[out.index]]:
                new_ids = new_ids[1:]
                del repeated[out.index]
            yield self._relay(req, out, new_ids)

    def _relay(self, req: Request, out: RequestOutput, new_ids: list[int]) -> TokenDelta:
        """One worker output, as the client's delta."""
        if req.relayed(out, new_ids, time.monotonic()):
            self._first_token_out(req)
        delta = delta_from_output(out, _usage(req.trace))
        delta.token_ids = new_ids
        return delta

    def _first_token_out(self, req: Request) -> None:
        trace, rid = req.trace, req.request_id
        ttft_s = trace.first_token_s - trace.arrived_s
        self.conductor.on_event(FirstToken(rid, trace.first_token_s, ttft_s, trace.handoff_s))
        if req.prefills_where_it_decodes:  # it is running there already
            self.conductor.on_event(PrefillDone(rid, trace.first_token_s))
            self.conductor.on_event(DecodeJoined(rid, trace.first_token_s))

    async def wait_released(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the releases under way, e.g. when the server stops."""
        pending = [req.releasing for req in self.requests.in_flight() if req.releasing]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    async def _release(self, req: Request) -> None:
        """Give back everything `req` holds (run once, by `Request.close`)."""
        try:
            await self.dispatch.end(req)
        finally:
            trace, rid = req.trace, req.request_id
            self.conductor.on_event(Finished(rid, time.monotonic(), trace.num_output_tokens))
            self.requests.finish(req)
            req.released()
            if self.observer is not None:
                self.observer(trace)

    def _check_queue(self, rid: str) -> None:
        """Reject at arrival once the requests waiting for a first token reach the bound."""
        if self.max_queued_per_worker is not None:
            kind = "prefill" if self.pool.mode == "disaggregated" else "decode"
            num_workers = max(len(self.pool.alive(kind)), 1)
            check_queue(self.requests, rid, self.max_queued_per_worker, kind, num_workers)

    async def abort(self, request_id: str) -> bool:
        """End a request in flight: its stream ends with finish reason `abort`."""
        req = self.requests.get(request_id)
        if req is None or req.finished or req.aborted:
            return False
        req.aborted = True
        await self.dispatch.abort(req)
        return True

    def in_flight_on(self, name: str | None) -> int:
        """Requests in flight that worker `name` has a part in (to drain before removal); all
        requests in flight with None."""
        return self.requests.num_in_flight() if name is None else self.requests.on_worker(name)

    async def poll(self) -> PollReport:
        """Poll every worker and store node; the Conductor learns what they report."""
        return await self.pool.poll()

    def pool_signals(self, kind: str, now: float) -> dict[str, float]:
        """The autoscaling signals of pool `kind`, per replica."""
        return self.pool.signals(kind, now)


def _usage(trace: RequestTrace) -> Usage:
    return Usage(trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)


def _finished_delta(req: Request) -> TokenDelta:
    """The end of a stream whose every token was out when its worker died."""
    req.end("finished")
    return TokenDelta([], "", finish_reason="length", usage=_usage(req.trace))


def _aborted_delta(req: Request) -> TokenDelta:
    req.end("cancelled")
    return TokenDelta([], "", finish_reason="abort", usage=_usage(req.trace))


def _reason_kind(message: str) -> str:
    """A short label for a rejection (the metric's `reason`), from the Conductor's message."""
    lowered = message.lower()
    for kind in ("ttft", "tbt"):
        if kind in lowered:
            return kind
    return "capacity"
