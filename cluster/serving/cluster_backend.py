"""The cluster's `Backend`: each request goes through the Conductor to a prefill and a decode
worker, and the decode worker's token stream is relayed back to the client."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from halfmoon.cluster.serving.backend import (
    DuplicateRequestError,
    GenerateInput,
    ModelInfo,
    NoWorkerError,
    RejectedError,
    TokenDelta,
    Usage,
    WorkerDiedError,
    delta_from_output,
)
from halfmoon.cluster.serving.request_lease import Attempt, RequestLease
from halfmoon.engine.errors import InvalidRequestError, RequestNotFoundError
from halfmoon.engine.llm_engine import RequestOutput
from halfmoon.engine.tokenizer import tokenize_prompt
from halfmoon.engine.worker_errors import WorkerCallError, aborted, unwrap
from halfmoon.engine.worker_info import WorkerInfo
from halfmoon.kvstore.keys import block_keys
from halfmoon.kvstore.kv_notices import KvPeer
from halfmoon.router.conductor import Conductor
from halfmoon.router.decision import Decision
from halfmoon.router.profile import profile_to_dict
from halfmoon.router.replication import Replication
from halfmoon.router.request import RouteRequest

log = logging.getLogger(__name__)
MAX_WAIT_FOR_ROOM_S = 120.0
ROOM_POLL_S = 0.05
MAX_ATTEMPTS = 3  # tries per request when the workers it was sent to die
RELEASE_WAIT_S = 10.0  # the longest a release waits on one worker call
# Prompts longer than this are tokenized in a thread, so a huge one never stalls the event
# loop that serves every other request (tokenizers release the GIL as they go).
INLINE_TOKENIZE_CHARS = 2048
TOKENIZE_THREADS = 4
RECENT_TRACES = 1024  # finished requests whose timeline `explain` can still show


@dataclass(slots=True)
class Worker:
    name: str
    kind: str
    handle: ray.actor.ActorHandle
    store_name: str | None = None
    kv_peer: KvPeer | None = None  # a decode worker's socket for prefill workers' notices
    draining: bool = False
    dead: bool = False  # a call to it failed: no new requests until it answers again


@dataclass(slots=True)
class RequestTrace:
    """Timestamps of one request as the router saw them (monotonic seconds)."""

    arrived_s: float
    num_prompt_tokens: int = 0
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_started_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    num_output_tokens: int = 0
    predicted_ttft_s: float | None = None
    prefill_compute_s: float | None = None  # the prefill worker's first to last step
    # The prefill's first token and its logprobs, streamed before the decode worker's output.
    early_token: tuple | None = None
    outcome: str = "error"
    reason: str = ""
    arrived_wall_s: float = dataclasses.field(default_factory=time.time)
    # (stage, seconds since arrival) in the order they happened: `halfmoon status --explain`.
    timeline: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def mark(self, stage: str, at_s: float | None = None) -> None:
        """Note that `stage` was reached now (or at monotonic time `at_s`)."""
        when = time.monotonic() if at_s is None else at_s
        self.timeline.append((stage, when - self.arrived_s))

    def mark_wall(self, stage: str, wall_s: float) -> None:
        """Note a stage a worker timed with its wall clock (time.time())."""
        if wall_s:
            self.timeline.append((stage, wall_s - self.arrived_wall_s))

    def explain_timeline(self) -> str:
        workers = ", ".join(
            f"{kind} {name}"
            for kind, name in (("prefill", self.prefill_instance), ("decode", self.decode_instance))
            if name
        )
        lines = [f"timeline ({self.outcome}; {workers}; ms since arrival at the router):"]
        for stage, offset_s in sorted(self.timeline, key=lambda item: item[1]):
            lines.append(f"  {offset_s * 1e3:9.2f}  {stage}")
        return "\n".join(lines)


class ClusterBackend:
    """Routes with the Conductor (disaggregated) or least-loaded (colocated) and relays tokens."""

    def __init__(
        self,
        tokenizer,
        info: WorkerInfo,
        conductor: Conductor,
        mode: str,
        observer=None,
        model_name: str | None = None,
        max_queued_per_worker: int | None = None,
        *,
        pool_wait_s: float,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.model_name = model_name or info.model
        self.conductor = conductor
        self.mode = mode
        self.observer = observer
        self.workers: dict[str, Worker] = {}
        self.leases: dict[str, RequestLease] = {}  # the requests in flight, by id
        self.stores: dict[str, ray.actor.ActorHandle] = {}
        self.max_wait_for_room_s = MAX_WAIT_FOR_ROOM_S
        self.pool_wait_s = pool_wait_s
        self.max_queued_per_worker = max_queued_per_worker
        self.copies: set[asyncio.Task] = set()
        self.recent_traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._thread_tokenizers = threading.local()

    def add_worker(self, worker: Worker) -> None:
        self.workers[worker.name] = worker
        self._route_to(worker)

    def _route_to(self, worker: Worker) -> None:
        if worker.kind == "prefill":
            self.conductor.add_prefill(worker.name)
        else:
            self.conductor.add_decode(worker.name, self.info.num_pages * self.info.block_size)

    def remove_worker(self, name: str) -> None:
        self.workers.pop(name, None)
        self.conductor.remove_instance(name)

    def set_draining(self, name: str, draining: bool) -> None:
        """A draining worker gets no new requests; the ones it has finish."""
        worker = self.workers[name]
        worker.draining = draining
        if draining:
            self.conductor.remove_instance(name)
        elif not worker.dead:
            self._route_to(worker)

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        if rid in self.leases:  # checked before anything is taken: the first one goes on
            raise DuplicateRequestError(
                f"request_id={rid!r} is already in flight; pick another id, or send none "
                "to get a server-assigned one"
            )
        lease = self.leases[rid] = RequestLease(rid, RequestTrace(time.monotonic()))
        trace = lease.trace
        try:
            self._check_queue(rid)
            token_ids = await self._tokenize(request)
            trace.mark("tokenized")
            if request.to_context_end:
                left = max(self.info.max_model_len - len(token_ids), 1)
                request.params = dataclasses.replace(request.params, max_tokens=left)
            self._check_fits(len(token_ids), request.params.max_tokens)
            trace.num_prompt_tokens = len(token_ids)
            async for delta in self._serve(request, token_ids, lease):
                yield delta
        except (GeneratorExit, asyncio.CancelledError):
            trace.outcome = "cancelled"
            raise
        except InvalidRequestError:
            trace.outcome = "invalid"
            raise
        except RejectedError as error:
            trace.outcome, trace.reason = "rejected", _reason_kind(str(error))
            raise
        finally:
            await lease.close(self._release)

    async def _serve(
        self, request: GenerateInput, token_ids: list[int], lease: RequestLease
    ) -> AsyncIterator[TokenDelta]:
        """Serve the request, moving it to other workers while a dead one (or one whose KV never
        arrived) had streamed none of it (beyond the prefill's first token, which the next
        decode worker continues from)."""
        while True:
            try:
                async for delta in self._attempt(request, token_ids, lease):
                    yield delta
                return
            except WorkerCallError as error:
                if lease.aborted:
                    yield self._aborted_delta(lease.trace)
                    return
                if not error.retryable or lease.streamed or lease.num_attempts >= MAX_ATTEMPTS:
                    raise
                await self._retry(lease, error)
            except WorkerDiedError as error:
                if lease.streamed or lease.aborted or lease.num_attempts >= MAX_ATTEMPTS:
                    raise
                await self._retry(lease, error)

    async def _retry(self, lease: RequestLease, why: Exception) -> None:
        """Give up the current attempt and start a fresh one on other workers."""
        log.warning("retrying request %s on other workers: %s", lease.request_id, why)
        await self._end_attempt(lease)
        self.conductor.on_abandon(lease.request_id)
        lease.retry()

    async def _attempt(
        self, request: GenerateInput, token_ids: list[int], lease: RequestLease
    ) -> AsyncIterator[TokenDelta]:
        rid, trace = lease.request_id, lease.trace
        worker, stream = await self._start(request, token_ids, lease)
        early = trace.early_token
        if early is not None and not lease.early_sent:  # out now, not after the hand-off
            lease.early_sent = True
            trace.num_output_tokens = 1
            trace.first_token_s = trace.last_token_s = time.monotonic()
            trace.mark("first token out", trace.first_token_s)
            self._observe_first_token(rid, trace)
            yield TokenDelta([early[0]], "", logprobs=[early[1]] if early[1] else [])
        async for out in self._outputs(worker, stream, lease.attempt):
            if out.timeline and not lease.streamed:
                role = "worker" if trace.prefill_instance is None else "decode worker"
                for stage, wall_s in out.timeline:
                    trace.mark_wall(f"{role}: {stage}", wall_s)
            new_ids = out.new_token_ids
            if early is not None and new_ids[:1] == [early[0]]:
                new_ids, early = new_ids[1:], None  # streamed already
            trace.num_output_tokens += len(new_ids)
            if out.finished:
                lease.attempt.ended = True
                trace.outcome = "cancelled" if out.finish_reason == "abort" else "finished"
            if trace.first_token_s is None and new_ids:
                trace.first_token_s = time.monotonic()
                trace.mark("first token out", trace.first_token_s)
                self._observe_first_token(rid, trace)
            elif not lease.streamed:
                trace.mark("first decode output")
            trace.last_token_s = time.monotonic()
            delta = self._delta(out, trace)
            delta.token_ids = new_ids
            lease.streamed = True
            yield delta

    async def _outputs(
        self, worker: Worker, stream, attempt: Attempt
    ) -> AsyncIterator[RequestOutput]:
        """The worker's streamed outputs; its errors raised here, as the router's."""
        try:
            refs = aiter(stream)
            if attempt.stored is not None:
                first = await self._first_unless_kv_lost(refs, attempt)
                if first is None:
                    return
                yield unwrap(await first)
            async for ref in refs:
                yield unwrap(await ref)
        except RayActorError as error:
            raise self._lost(worker, error) from error

    async def _first_unless_kv_lost(self, refs, attempt: Attempt):
        """The decode worker's first output (its ObjectRef; None if the stream is empty),
        unless the prefill worker dies or fails to store the KV first: that raises at once
        (retryable), where the decode worker would wait `store.get_timeout_s` for it."""
        first = asyncio.ensure_future(anext(refs, None))
        stored = asyncio.ensure_future(self._call(attempt.prefill, attempt.stored))
        try:
            await asyncio.wait({first, stored}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and stored.exception() is not None:
                error = stored.exception()
                if isinstance(error, (WorkerDiedError, WorkerCallError)):
                    raise error
                log.warning("waiting for the KV of an attempt to be stored failed: %r", error)
            return await first
        finally:
            for task in (first, stored):
                if task.done() and not task.cancelled():
                    task.exception()  # read, so an outcome nobody needed is not logged
                task.cancel()

    async def _call(self, worker: Worker, ref):
        """Await one worker call; a dead worker is routed around from now on."""
        try:
            return unwrap(await ref)
        except RayActorError as error:
            raise self._lost(worker, error) from error

    def _lost(self, worker: Worker, error: RayActorError) -> Exception:
        if isinstance(error, RayTaskError):  # the worker is alive; something it called failed
            return error
        self.mark_dead(worker.name)
        log.warning("worker %s failed a call: %s", worker.name, error)
        return WorkerDiedError(f"worker {worker.name} died while serving the request")

    def mark_dead(self, name: str) -> None:
        """Route no more requests to `name` (its call failed) until it answers again."""
        worker = self.workers.get(name)
        if worker is None or worker.dead:
            return
        worker.dead = True
        self.conductor.remove_instance(name)
        log.warning("routing around worker %s until it answers or is replaced", name)

    def mark_alive(self, name: str) -> None:
        """A worker marked dead answered a call: route to it again."""
        worker = self.workers.get(name)
        if worker is not None and worker.dead:
            worker.dead = False
            if not worker.draining:
                self._route_to(worker)

    def _pool_kinds(self) -> tuple[str, ...]:
        """The pools a request needs: decode alone when colocated."""
        return ("decode",) if self.mode == "colocated" else ("prefill", "decode")

    def _missing_pool(self) -> str | None:
        return next((kind for kind in self._pool_kinds() if not self._alive(kind)), None)

    async def wait_released(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the releases under way, e.g. when the server stops."""
        pending = [lease.releasing for lease in self.leases.values() if lease.releasing]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    async def _release(self, lease: RequestLease) -> None:
        """Give back everything `lease` holds (run once, by `RequestLease.close`)."""
        try:
            await self._end_attempt(lease)
        finally:
            trace = lease.trace
            self.conductor.on_finish(lease.request_id, time.monotonic(), trace.num_output_tokens)
            self.leases.pop(lease.request_id, None)
            trace.mark("released")
            self.recent_traces[lease.request_id] = trace
            while len(self.recent_traces) > RECENT_TRACES:
                self.recent_traces.popitem(last=False)
            if self.observer is not None:
                self.observer(trace)

    async def _end_attempt(self, lease: RequestLease) -> None:
        """Abort the attempt on its live workers, once a reserve already sent has landed (or
        not in time: its ticket then refuses it when it lands)."""
        attempt = lease.attempt
        if attempt.ended:
            return

        async def abort(worker: Worker, first=None) -> None:
            if first is not None:
                await _settled(first, RELEASE_WAIT_S)
            ref = worker.handle.abort.remote(lease.request_id, attempt.ticket)
            if not await _settled(ref, RELEASE_WAIT_S):
                log.warning("%s did not answer the abort of %s", worker.name, lease.request_id)

        calls = [abort(attempt.prefill)] if attempt.prefill and not attempt.prefill.dead else []
        if attempt.decode is not None and not attempt.decode.dead:
            calls.append(abort(attempt.decode, attempt.reserve))
        await asyncio.gather(*calls)
        attempt.ended = True  # only now: a cancel midway leaves the release to do it again

    def _aborted_delta(self, trace: RequestTrace) -> TokenDelta:
        trace.outcome = "cancelled"
        usage = Usage(trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)
        return TokenDelta([], "", finish_reason="abort", usage=usage)

    def _observe_first_token(self, rid: str, trace: RequestTrace) -> None:
        ttft_s = trace.first_token_s - trace.arrived_s
        self.conductor.observe_ttft(rid, ttft_s)
        if trace.prefill_compute_s is not None:  # disaggregated: what it paid beyond compute
            overhead_s = self.conductor.profile.request_overhead_s
            self.conductor.observe_handoff(ttft_s - trace.prefill_compute_s - overhead_s)

    def _check_queue(self, rid: str) -> None:
        """Reject at arrival once the requests waiting for a first token reach the bound."""
        if self.max_queued_per_worker is None:
            return
        kind = "prefill" if self.mode == "disaggregated" else "decode"
        num_workers = max(len(self._alive(kind)), 1)
        bound = self.max_queued_per_worker * num_workers
        waiting = sum(1 for lease in self.leases.values() if lease.trace.first_token_s is None) - 1
        if waiting >= bound:
            raise RejectedError(
                f"request {rid} rejected: {waiting} requests already wait for a first token "
                f"(bound {self.max_queued_per_worker} per {kind} worker x {num_workers}, "
                "router.max_queued_per_worker); retry later or add workers"
            )

    async def _tokenize(self, request: GenerateInput) -> list[int]:
        if _prompt_chars(request.prompt) <= INLINE_TOKENIZE_CHARS:
            token_ids = tokenize_prompt(self.tokenizer, request.prompt, self.info.vocab_size)
        else:
            loop = asyncio.get_running_loop()
            token_ids = await loop.run_in_executor(
                self.tokenize_pool, self._tokenize_in_thread, request.prompt
            )
        if len(token_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{len(token_ids)} tokens>",
                f"must be shorter than the context length of {self.info.max_model_len} tokens",
            )
        return token_ids

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Prompt and output must fit the context: a request that cannot is refused now."""
        limit = self.info.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens",
                max_tokens,
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens must fit the "
                f"context length of {limit} tokens; ask for at most "
                f"{limit - num_prompt_tokens} tokens",
            )

    def _tokenize_in_thread(self, prompt) -> list[int]:
        # Each thread its own copy: a fast tokenizer shared across threads can fail with
        # "Already borrowed" when one call changes its truncation settings.
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = deepcopy(self.tokenizer)
        return tokenize_prompt(tokenizer, prompt, self.info.vocab_size)

    async def _start(self, request: GenerateInput, token_ids: list[int], lease: RequestLease):
        """Place the attempt and start it; returns the worker that streams and its stream."""
        rid, params, trace, attempt = request.request_id, request.params, lease.trace, lease.attempt
        trace.prefill_instance = trace.decode_instance = None
        if self.mode == "colocated":
            worker = attempt.decode = await self._pick_colocated(lease)
            trace.decode_instance = worker.name
            trace.prefill_started_s = time.monotonic()
            trace.mark("sent to the worker", trace.prefill_started_s)
            return worker, worker.handle.generate_colocated.options(num_returns="streaming").remote(
                rid, token_ids, params, attempt.ticket
            )
        keys = block_keys(self.info.root_key, token_ids, self.info.block_size)
        # The engine stops at the context length, so no request holds KV beyond it.
        max_output_tokens = min(params.max_tokens, self.info.max_model_len - len(token_ids))
        route = RouteRequest(
            rid, keys, len(token_ids), max_output_tokens, trace.arrived_s,
            ttft_slo_s=request.ttft_slo_s, tbt_slo_s=request.tbt_slo_s,
        )  # fmt: skip
        decision = await self._route(route, lease)
        trace.mark("routed")
        trace.predicted_ttft_s = decision.predicted_ttft_s
        if decision.rejected:
            raise RejectedError(f"request {rid} rejected: {decision.reason}")
        self._replicate(decision)
        decode = attempt.decode = self.workers[decision.decode_instance]
        trace.decode_instance = decode.name
        if decision.bypass:
            if lease.early_sent:  # its first token is out: only a plain hand-off continues it
                raise WorkerDiedError(f"request {rid} lost its decode worker after its first token")
            return decode, decode.handle.generate_colocated.options(num_returns="streaming").remote(
                rid, token_ids, params, attempt.ticket
            )
        prefill = attempt.prefill = self.workers[decision.prefill_instance]
        trace.prefill_instance = prefill.name
        # Reserve and prefill start together: the decode worker's reads wait in the store for
        # the layers, so neither waits for the other's round trip. A reserve that fails ends
        # the attempt, and its release aborts the prefill by ticket.
        # A decode worker with a notice socket hears of each layer and of the first token from
        # the prefill worker itself when both are on one node, and joins its batch then; a
        # retry's first token is out already, so the reserve carries it.
        peer = decode.kv_peer
        known = trace.early_token[0] if trace.early_token is not None else None
        attempt.reserve = decode.handle.reserve.remote(
            rid, token_ids, params, prefill.store_name, attempt.ticket, peer is not None, known
        )
        prefilled = prefill.handle.prefill.remote(
            rid, token_ids, params, True, attempt.ticket, peer
        )
        trace.prefill_started_s = time.monotonic()
        self.conductor.on_prefill_start(rid, trace.prefill_started_s)
        await self._call(decode, attempt.reserve)
        trace.mark("decode pages reserved")
        result = await self._call(prefill, prefilled)
        now = time.monotonic()
        trace.mark("prefill returned", now)
        for stage, wall_s in (
            ("prefill call began on the worker", result.arrived_at),
            ("prefill compute began", result.started_at),
            ("prefill compute ended", result.computed_at),
            ("last layer published", result.last_layer_published_at),
            ("prefill call returned on the worker", result.finished_at),
        ):
            trace.mark_wall(stage, wall_s)
        self.conductor.on_prefill_done(rid, now)
        cached = result.num_local_cached_tokens + result.num_loaded_tokens
        # The cost model is refined from the workers' engine steps (RouterActor polls them).
        trace.prefill_compute_s = result.computed_at - result.started_at
        trace.num_cached_tokens, trace.num_loaded_tokens = cached, result.num_loaded_tokens
        if trace.early_token is None:  # a retry continues from the first token already out
            trace.early_token = (result.first_token_id, result.logprobs)
        self.conductor.on_decode_join(rid, now)
        attempt.stored = prefill.handle.stored.remote(rid, attempt.ticket)
        return decode, decode.handle.generate.options(num_returns="streaming").remote(
            rid, trace.early_token[0]
        )

    def _replicate(self, decision: Decision) -> None:
        """Start the decision's hot-prefix copies beside the request, never in its way."""
        for copy in decision.replications:
            task = asyncio.get_running_loop().create_task(self._copy(copy))
            self.copies.add(task)
            task.add_done_callback(self.copies.discard)

    async def _copy(self, copy: Replication) -> None:
        source = copy.source[0]
        holder = self.workers.get(source)
        store_name = holder.store_name if holder is not None else source
        try:
            target = self.workers.get(copy.target)
            if target is not None:
                await target.handle.warm.remote(list(copy.keys), store_name)
        except Exception:  # noqa: BLE001 - a failed copy costs hits, never a request
            log.exception("copying %d hot blocks to %s failed", len(copy.keys), copy.target)
        finally:
            self.conductor.on_replicated(copy)

    async def _route(self, route: RouteRequest, lease: RequestLease) -> Decision:
        """Route; while no decode worker has room for the KV, wait for some (up to
        `max_wait_for_room_s`), and while a pool has no live worker, wait for a replacement
        (up to `pool_wait_s`) instead of failing: that is queueing, not an SLO rejection."""
        started = time.monotonic()
        while True:
            self._check_aborted(lease)
            now = time.monotonic()
            missing = self._missing_pool()
            if missing is None:
                decision = self.conductor.route(route, now)
                no_room = decision.rejected and decision.decode_instance is None
                if not no_room or now > route.arrival_s + self.max_wait_for_room_s:
                    return decision
            elif now > started + self.pool_wait_s:
                raise NoWorkerError(
                    f"no live {missing} worker for {self.pool_wait_s:g} s (router.pool_wait_s) "
                    f"to serve request {route.request_id}; check `halfmoon status`"
                )
            await asyncio.sleep(ROOM_POLL_S)

    async def _pick_colocated(self, lease: RequestLease) -> Worker:
        """The least loaded live worker, waiting up to `pool_wait_s` for one."""
        started = time.monotonic()
        while not self._alive("decode"):
            self._check_aborted(lease)
            if time.monotonic() > started + self.pool_wait_s:
                raise NoWorkerError(
                    f"no live worker for {self.pool_wait_s:g} s (router.pool_wait_s); "
                    "check `halfmoon status`"
                )
            await asyncio.sleep(ROOM_POLL_S)
        return self._least_loaded("decode")

    @staticmethod
    def _check_aborted(lease: RequestLease) -> None:
        if lease.aborted:
            raise WorkerCallError(aborted(lease.request_id))

    def _delta(self, out: RequestOutput, trace: RequestTrace) -> TokenDelta:
        if out.finished and trace.prefill_instance is None:  # prefilled where it decoded
            trace.num_cached_tokens = out.num_cached_tokens
        usage = Usage(trace.num_prompt_tokens, trace.num_output_tokens, trace.num_cached_tokens)
        return delta_from_output(out, usage)

    async def abort(self, request_id: str) -> bool:
        """End a request in flight: its stream ends with finish reason `abort`."""
        lease = self.leases.get(request_id)
        if lease is None or lease.aborted:
            return False
        lease.aborted = True
        attempt = lease.attempt
        for worker in attempt.workers():
            try:
                await worker.handle.abort.remote(request_id, attempt.ticket)
            except RayActorError:
                log.warning("could not abort %s on %s: the worker is gone", request_id, worker.name)
        return True

    def timeline(self, request_id: str) -> list[tuple[str, float]]:
        """(stage, seconds since arrival) of a request in flight or recently finished."""
        trace = self._kept_trace(request_id)
        if trace is None:
            raise RequestNotFoundError(request_id)
        return sorted(trace.timeline, key=lambda item: item[1])

    def _kept_trace(self, request_id: str) -> RequestTrace | None:
        """The trace of a request in flight or among the last RECENT_TRACES finished."""
        lease = self.leases.get(request_id)
        return lease.trace if lease is not None else self.recent_traces.get(request_id)

    async def explain(self, request_id: str) -> str:
        """The Conductor's decision (disaggregated) and the request's timeline, if still kept."""
        parts = []
        with contextlib.suppress(KeyError):
            parts.append(self.conductor.explain(request_id))
        trace = self._kept_trace(request_id)
        if trace is not None:
            parts.append(trace.explain_timeline())
        if not parts:
            raise RequestNotFoundError(request_id)
        return "\n".join(parts)

    async def model_info(self) -> ModelInfo:
        info = self.info
        return ModelInfo(
            self.model_name, info.architecture, info.vocab_size, info.max_model_len, info.block_size
        )

    async def server_info(self) -> dict:
        loads = {}
        for worker in self.workers.values():
            try:
                load = await worker.handle.load.remote()
                loads[worker.name] = {
                    "kind": worker.kind,
                    "draining": worker.draining,
                    "running": load.num_running,
                    "waiting": load.num_waiting,
                    "pages_used_ratio": round(load.pages_used_ratio, 4),
                }
                view = self.conductor.decode.get(worker.name)
                if view is not None:  # what the router holds back for requests placed there
                    loads[worker.name]["reserved_kv_tokens"] = view.reserved_tokens
            except RayActorError:
                loads[worker.name] = {"kind": worker.kind, "dead": True}
        stores = {}
        for name, store in self.stores.items():
            try:
                stats = await store.stats.remote()
                stores[name] = {
                    tier: dataclasses.asdict(getattr(stats, tier)) for tier in ("host", "redis")
                }
            except RayActorError:
                stores[name] = {"dead": True}
        error = dataclasses.asdict(self.conductor.prediction_error())
        return {
            "mode": self.mode,
            "model": self.model_name,
            "model_path": self.info.model,
            "workers": loads,
            "stores": stores,
            "policy": self.conductor.config.policy,
            "in_flight": len(self.leases),
            "health": dict(zip(("ok", "reason"), await self.health(), strict=True)),
            "ttft_prediction_error": error,
            # What a simulator needs to mirror this cluster (`halfmoon bench live-capacity`):
            # the router's settings and its profile as it stands (measured, refit online).
            "router": dataclasses.asdict(self.conductor.config),
            "profile": profile_to_dict(self.conductor.profile),
        }

    async def health(self) -> tuple[bool, str]:
        counts = {kind: len(self._alive(kind)) for kind in self._pool_kinds()}
        missing = [kind for kind, count in counts.items() if count == 0]
        live = ", ".join(f"{count} {kind}" for kind, count in counts.items())
        if missing:
            return False, f"no live {' or '.join(missing)} worker ({live})"
        return True, f"serving ({live})"

    def _alive(self, kind: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.kind == kind and not (w.draining or w.dead)]

    def _least_loaded(self, kind: str) -> Worker:
        workers = self._alive(kind)
        if not workers:
            raise NoWorkerError(f"no {kind} worker is alive; check `halfmoon status`")
        busy = {w.name: 0 for w in workers}
        for lease in self.leases.values():
            decode = lease.attempt.decode
            if decode is not None and decode.name in busy:
                busy[decode.name] += 1
        return min(workers, key=lambda w: busy[w.name])


def _prompt_chars(prompt) -> int:
    """About how much tokenizing a prompt costs: characters of text, or list entries."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(
        len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1
        for m in prompt
    )


def _reason_kind(message: str) -> str:
    """A short label for a rejection (the metric's `reason`), from the Conductor's message."""
    lowered = message.lower()
    for kind in ("ttft", "tbt"):
        if kind in lowered:
            return kind
    return "capacity"


async def _settled(ref, timeout_s: float) -> bool:
    """Wait (up to `timeout_s`) for a worker call already sent, however it ends; False if it
    did not end in time."""
    try:
        await asyncio.wait_for(_ended(ref), timeout_s)
    except TimeoutError:
        return False
    return True


async def _ended(ref) -> None:
    with contextlib.suppress(Exception):  # only its end matters here, not its result
        await ref
