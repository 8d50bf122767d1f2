"""One attempt of a request: placed by the Conductor, sent to its workers as typed tasks, its
stream relayed, and ended (by ticket) on its live workers when it is given up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError

from halfmoon.cluster.serving.backend import NoWorkerError, RejectedError, WorkerDiedError
from halfmoon.cluster.serving.registry import RequestRegistry
from halfmoon.cluster.serving.request import Attempt, Request
from halfmoon.cluster.serving.workers import Worker, WorkerPool
from halfmoon.cluster.worker.errors import WorkerCallError, aborted, unwrap
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.engine.llm_engine import RequestOutput
from halfmoon.prefill_worker.task import PrefillResult, PrefillTask
from halfmoon.router.conductor import Conductor
from halfmoon.router.decision import Decision
from halfmoon.router.events import DecodeJoined, PrefillDone, Replicated
from halfmoon.router.replication import Replication

log = logging.getLogger(__name__)
MAX_WAIT_FOR_ROOM_S = 120.0
ROOM_POLL_S = 0.05
RELEASE_WAIT_S = 10.0  # the longest a release waits on one worker call


class Dispatcher:
    """Starts, relays and ends the attempts of requests on the pool's workers."""

    def __init__(
        self, pool: WorkerPool, registry: RequestRegistry, conductor: Conductor, pool_wait_s: float
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.conductor = conductor
        self.pool_wait_s = pool_wait_s
        self.max_wait_for_room_s = MAX_WAIT_FOR_ROOM_S
        self.copies: set[asyncio.Task] = set()

    async def start(self, request: Request):
        """Place the attempt and start it; returns the worker that streams and its stream."""
        decision = await self._place(request)
        decode = self.pool.worker(decision.decode_instance)
        if self.pool.mode == "colocated":
            request.sent(None, decode)
            request.started(time.monotonic())
            return decode, self._whole(decode, request)
        if not decision.bypass:
            return decode, await self._prefill(request, decision, decode)
        if request.early_sent:  # its first token is out: only a plain hand-off continues it
            raise WorkerDiedError(
                f"request {request.request_id} lost its decode worker after its first token"
            )
        request.sent(None, decode)
        return decode, self._whole(decode, request)

    def _whole(self, worker: Worker, request: Request):
        """Prefill and decode the request on one worker (colocated, or a bypassed prompt)."""
        return worker.client.generate_colocated(_decode_task(request))

    async def _place(self, request: Request) -> Decision:
        decision = await self._route(request)
        request.routed(decision)
        if decision.rejected:
            raise RejectedError(f"request {request.request_id} rejected: {decision.reason}")
        self._replicate(decision)
        return decision

    async def _prefill(self, request: Request, decision: Decision, decode: Worker):
        """Reserve on `decode` and prefill on the decision's prefill worker; returns the
        decode worker's stream, which continues from the first token."""
        rid, attempt = request.request_id, request.attempt
        prefill = self.pool.worker(decision.prefill_instance)
        request.sent(prefill, decode)
        # Reserve and prefill start together: the decode worker's reads wait in the store for
        # the layers, so neither waits for the other's round trip. A reserve that fails ends
        # the attempt, and its release aborts the prefill by ticket.
        # A decode worker with a notice socket hears of each layer and of the first token from
        # the prefill worker itself when both are on one node, and joins its batch then; a
        # retry's first token is out already, so the reserve carries it.
        peer = decode.kv_peer
        known = _first_token_ids(request.first_tokens) if request.first_tokens else None
        reserve = _decode_task(request, prefill.store_name, peer is not None, known)
        attempt.reserve = decode.client.reserve(reserve)
        task = PrefillTask(
            rid,
            request.token_ids,
            request.params,
            request.block_keys,
            request.num_prior_output_tokens,
            ticket=attempt.ticket,
            kv_peer=peer,
            fetch_from=_fetch_store(decision, prefill),
        )
        prefilled = prefill.client.prefill(task)
        request.started(time.monotonic())
        await self.call(decode, attempt.reserve)
        request.note("decode pages reserved")
        self._prefilled(request, await self.call(prefill, prefilled))
        attempt.stored = prefill.client.stored(rid, attempt.ticket)
        return decode.client.generate(attempt.ticket, _first_token_ids(request.first_tokens))

    def _prefilled(self, request: Request, result: PrefillResult) -> None:
        """Note where the prefill's time went; its first token goes out next. The cost model
        is refined from the workers' engine steps (the pool polls them)."""
        rid, now = request.request_id, time.monotonic()
        request.prefilled(result, now)
        self.conductor.on_event(PrefillDone(rid, now))
        self.conductor.on_event(DecodeJoined(rid, now))

    async def outputs(
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
        stored = asyncio.ensure_future(self.call(attempt.prefill, attempt.stored))
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

    async def call(self, worker: Worker, ref):
        """Await one worker call; a dead worker is routed around from now on."""
        try:
            return unwrap(await ref)
        except RayActorError as error:
            raise self._lost(worker, error) from error

    def _lost(self, worker: Worker, error: RayActorError) -> Exception:
        if isinstance(error, RayTaskError):  # the worker is alive; something it called failed
            return error
        self.pool.mark_dead(worker.name)
        log.warning("worker %s failed a call: %s", worker.name, error)
        return WorkerDiedError(f"worker {worker.name} died while serving the request")

    async def end(self, request: Request) -> None:
        """Abort the attempt on its live workers, once a reserve already sent has landed (or
        not in time: its ticket then refuses it when it lands)."""
        attempt = request.attempt
        if attempt.ended:
            return
        rid, ticket, prefill, decode = (
            request.request_id,
            attempt.ticket,
            attempt.prefill,
            attempt.decode,
        )
        calls = [_abort(prefill, rid, ticket, None)] if prefill and not prefill.dead else []
        if decode is not None and not decode.dead:
            calls.append(_abort(decode, rid, ticket, attempt.reserve))
        await asyncio.gather(*calls)
        attempt.ended = True  # only now: a cancel midway leaves the release to do it again

    async def abort(self, request: Request) -> None:
        """Ask the attempt's workers to end it now (the client's Abort)."""
        attempt = request.attempt
        for worker in attempt.workers():
            try:
                await worker.client.abort(request.request_id, attempt.ticket)
            except RayActorError:
                log.warning(
                    "could not abort %s on %s: the worker is gone", request.request_id, worker.name
                )

    async def _route(self, request: Request) -> Decision:
        """Route; while no decode worker has room for the KV, wait for some (up to
        `max_wait_for_room_s`), and while a pool has no live worker, wait for a replacement
        (up to `pool_wait_s`) instead of failing: that is queueing, not an SLO rejection."""
        route, started = request.route, time.monotonic()
        while True:
            _check_aborted(request)
            now = time.monotonic()
            missing = self.pool.missing_pool()
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

    def _replicate(self, decision: Decision) -> None:
        """Start the decision's hot-prefix copies beside the request, never in its way."""
        for copy in decision.replications:
            task = asyncio.get_running_loop().create_task(self._copy(copy))
            self.copies.add(task)
            task.add_done_callback(self.copies.discard)

    async def _copy(self, copy: Replication) -> None:
        store_name = self.pool.store_of(copy.source[0])
        try:
            target = self.pool.get(copy.target)
            if target is not None:
                await target.client.warm(list(copy.keys), store_name)
        except Exception:  # noqa: BLE001 - a failed copy costs hits, never a request
            log.exception("copying %d hot blocks to %s failed", len(copy.keys), copy.target)
        finally:
            self.conductor.on_event(Replicated(copy, time.monotonic()))


def _first_token_ids(first_tokens: list[tuple]) -> int | list[int]:
    """What the decode worker joins after: the first token, or each sequence's (n > 1)."""
    ids = [token_id for token_id, _ in first_tokens]
    return ids if len(ids) > 1 else ids[0]


def _decode_task(
    request: Request,
    store_name: str | None = None,
    direct: bool = False,
    first_token_id: int | list[int] | None = None,
) -> DecodeTask:
    return DecodeTask(
        request.request_id,
        request.token_ids,
        request.params,
        request.block_keys,
        request.num_prior_output_tokens,
        store_name=store_name,
        ticket=request.attempt.ticket,
        direct=direct,
        first_token_id=first_token_id,
    )


def _fetch_store(decision: Decision, prefill: Worker) -> str | None:
    """The store node of another node whose host tier the decision fetches a prefix from
    (a fetch out of Redis or this node's store is the prefill worker's own lookup)."""
    source = decision.fetch_from
    if source is None or source[1] != "host" or source[0] == prefill.store_name:
        return None
    return str(source[0])


def _check_aborted(request: Request) -> None:
    if request.aborted:
        raise WorkerCallError(aborted(request.request_id))


async def _abort(worker: Worker, request_id: str, ticket: str, first) -> None:
    """Abort attempt `ticket` on `worker`, after `first` (a call already sent) has ended."""
    if first is not None:
        await _settled(first, RELEASE_WAIT_S)
    ref = worker.client.abort(request_id, ticket)
    if not await _settled(ref, RELEASE_WAIT_S):
        log.warning("%s did not answer the abort of %s", worker.name, request_id)


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
