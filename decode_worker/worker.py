"""The decode worker: reserves pages, pulls each layer of a prompt's KV from the store as it
lands (or, on the prefill worker's node, copies it out of the prefill worker's own pages or
the store's shared arena when the prefill worker says it is there), joins the request to its
continuous batch as soon as the last layer and the first token are in, and streams the tokens
back.

The actor takes `DecodeTask`s; the receive (receive.py) and the notices from prefill workers
on this node (notices.py) live beside it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import ray

from halfmoon.cluster.worker.actor import EngineWorker
from halfmoon.cluster.worker.errors import WorkerError, aborted
from halfmoon.decode_worker.engine_receive import EngineReceiver
from halfmoon.decode_worker.notices import EARLY_NOTICE_S, Notices, Reservation
from halfmoon.decode_worker.receive import Receiver, ReceiveTimings
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import LLMEngine, RequestOutput
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.locate import local_store_name
from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.kvstore.transfer.staging import Grant

log = logging.getLogger(__name__)
# A reservation whose KV has landed (or whose receive failed) and that no `generate` claims
# within this many seconds is freed: the router that made it died or lost track of it. The
# router hands over as soon as its prefill returns, a moment before its last layers land.
HANDOFF_TIMEOUT_S = 60.0
# Ids of reservations freed that way, kept so a late `generate` says why it finds none.
EXPIRED_IDS = 1024


class DecodeWorker(EngineWorker):
    """Continuous-batching decode over KV received from the store; also serves colocated mode."""

    kind = "decode"

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        store=None,
        get_timeout_s: float = 30.0,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
        early_notice_s: float = EARLY_NOTICE_S,
        transfer: TransferSettings | None = None,
    ):
        super().__init__(name, LLMEngine(config))
        self.kv_cache = self.engine.kv_cache
        self.get_timeout_s = get_timeout_s
        self.handoff_timeout_s = handoff_timeout_s
        self.receives: dict[str, asyncio.Task] = {}  # reserved, not handed over yet
        # Handed over (`generate` waits for the last layer): whoever takes a receive out of
        # here (`generate` or `abort`) frees its pages, so a retry's later reservation under
        # the same request id is never freed or joined by the attempt it replaced.
        self.joining: dict[str, asyncio.Task] = {}
        self.expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired_reservations = 0
        self.num_early_joins = 0
        self.notices = Notices(self.kv_cache, store, early_notice_s)
        engine = EngineReceiver(self.kv_cache, self.notices, transfer or TransferSettings())
        self.receiver = Receiver(self.kv_cache, self.notices, store, get_timeout_s, engine)

    def _extra_counters(self) -> dict:
        return {
            "num_receiving": len(self.receives) + len(self.joining),
            "num_expired_reservations": self.num_expired_reservations,
            "num_early_joins": self.num_early_joins,
            **self.receiver.counters(),
            **self.notices.counters(),
        }

    def _kv_transfer(self) -> str:
        return self.receiver.engine.path

    def __ray_shutdown__(self) -> None:
        """On a graceful exit: unregister the staging region (a kill takes it with the process:
        peers' writes are refused either way)."""
        self.receiver.engine.close()

    async def kv_peer(self) -> KvPeer:
        """Where prefill workers on this node send their notices (kvstore/transfer/channel.py),
        and how those on other nodes reach this worker's transfer engine, if it has one."""
        actor_name = ray.get_runtime_context().get_actor_name()
        engine = self.receiver.engine.address(actor_name)
        return dataclasses.replace(self.notices.peer(), engine=engine)

    async def kv_grant(self, key: str, accept: bool) -> Grant | None:
        """A prefill worker on another node starts the receive `key`: staging slots to write
        its KV into when it can (`accept`) and they are free, else None (the store's stream)."""
        return await self.receiver.engine.grant(key, accept, self.notices.early_notice_s)

    async def reserve(self, task: DecodeTask) -> int | WorkerError:
        """Hold pages for the prompt and start pulling its KV from the store node the prefill
        worker publishes to (`task.store_name`; default: ours); returns the pages held. A
        reserve whose `ticket` was aborted already holds nothing.

        `task.direct`: the prefill worker was given this worker's `kv_peer`; when that store
        is on this node, the layers are taken from its arena as the prefill worker's notices
        say. `task.first_token_id`: the request's first token, when already known (a retry):
        the request joins the batch as soon as its KV is in, as it does on the prefill
        worker's notice of the first token; otherwise on `generate`."""
        if self._was_aborted(task.ticket):
            return aborted(task.request_id)
        try:
            store = self.receiver.store_named(task.store_name)
            pages, fence = await self._engine().reserve(
                task.token_ids,
                task.params,
                task.request_id,
                task.block_keys,
                num_prior_output_tokens=task.num_prior_output_tokens,
            )
        except HalfmoonError as error:
            return WorkerError.of(error)
        key = task.ticket or task.request_id
        reservation = self.notices.add(task.request_id, key, task.direct, task.first_token_id)
        reservation.fence = fence  # on the step thread: the pages' last readers are before it
        reservation.num_tokens = len(task.token_ids)
        if task.direct and task.store_name not in (None, local_store_name()):
            self.receiver.engine.expect(reservation)  # its prefill worker is on another node
        timings = self.receiver.start(task.request_id)
        reservation.first_token.add_done_callback(
            lambda token: token.cancelled() or setattr(timings, "first_token_at", time.time())
        )
        receive = asyncio.create_task(self._receive(store, task, pages, reservation))
        receive.add_done_callback(lambda done: self._await_handoff(task.request_id, done))
        self.receives[task.request_id] = receive
        return len(pages)

    async def generate(
        self, request_id: str, first_token_id: int | list[int]
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Wait for the last layer, join the batch after the first token (with `n` > 1 a list,
        one per sequence: the request forks into them here), and stream the request's
        outputs; a failure is the last item, as a `WorkerError`."""
        called_at = time.time()
        receive = self.receives.pop(request_id, None)
        if receive is None:
            yield self._unreserved(request_id)
            return
        reservation = self.notices.reservation(request_id)
        if not reservation.first_token.done():
            reservation.first_token.set_result(first_token_id)
        self.joining[request_id] = receive
        failure = await _received(request_id, receive, self.get_timeout_s)
        if self.joining.get(request_id) is not receive:  # `abort` took it (and freed it)
            yield aborted(request_id)
            return
        del self.joining[request_id]
        if failure is not None:
            # Unless a retry's reserve (its abort of this attempt not yet here) holds the id.
            if self.notices.key_of(request_id) == reservation.key:
                self._free(request_id)
            yield failure
            return
        self.notices.forget(request_id)
        if reservation.join_error is not None:  # `_receive` joined the batch, or tried to
            yield WorkerError.of(reservation.join_error)
            return
        async for out in _timed(_as_data(self._engine().stream(request_id)), called_at):
            yield out

    def _unreserved(self, request_id: str) -> WorkerError:
        """Why a `generate` finds no reservation: freed unclaimed, or never made here."""
        if request_id in self.expired:
            return WorkerError(
                "UNAVAILABLE",
                f"the reservation of {request_id} was freed: nothing claimed it "
                f"{self.handoff_timeout_s:g} s after its KV landed",
                retryable=True,
            )
        return WorkerError("NOT_FOUND", f"request {request_id} has no reservation here")

    async def generate_colocated(
        self, task: DecodeTask
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Prefill and decode here (colocated mode and short-prompt bypass)."""
        called_at = time.time()
        if self._was_aborted(task.ticket):
            yield aborted(task.request_id)
            return
        outputs = self._engine().generate(
            task.token_ids,
            task.params,
            task.request_id,
            task.block_keys,
            num_prior_output_tokens=task.num_prior_output_tokens,
        )
        async for out in _timed(_as_data(outputs), called_at):
            yield out

    def _held_request_ids(self) -> set[str]:
        return set(self.receives) | set(self.joining)

    def _forget_store(self, name: str) -> None:
        self.receiver.forget_store(name)
        self.notices.forget_store(name)

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the request here and free its pages; a reserve or colocated call with the same
        `ticket` that lands later is refused. The abort of an earlier attempt that lands after
        a retry's reserve (Ray does not order them) leaves the retry's reservation alone."""
        self._remember_abort(ticket)
        if ticket is not None and self.notices.key_of(request_id) not in (None, ticket):
            return False
        receive = self.receives.pop(request_id, None) or self.joining.pop(request_id, None)
        if receive is not None:
            receive.cancel()
            return self._free(request_id)
        return self._engine().abort(request_id)

    def _await_handoff(self, request_id: str, receive: asyncio.Task) -> None:
        """The receive failed: free its pages unless `generate` or `abort` claims it within
        `handoff_timeout_s` (its router died between the reserve and the hand-off). A receive
        whose KV landed armed the same timer then (`_receive`)."""
        if receive.cancelled() or self.receives.get(request_id) is not receive:
            return  # aborted, or already handed over
        if receive.exception() is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.handoff_timeout_s, self._expire, request_id, receive)

    def _expire(self, request_id: str, receive: asyncio.Task) -> None:
        if self.receives.get(request_id) is not receive:
            return
        del self.receives[request_id]
        failure = None
        if receive.done() and not receive.cancelled():
            failure = receive.exception()  # retrieved, so asyncio does not log it as lost
        receive.cancel()  # it may wait for a first token that no hand-off will bring
        log.warning(
            "freed the reservation of %s: no hand-off %g s after its KV %s",
            request_id,
            self.handoff_timeout_s,
            "landed" if failure is None else f"failed ({failure})",
        )
        self.num_expired_reservations += 1
        self.expired[request_id] = None
        while len(self.expired) > EXPIRED_IDS:
            self.expired.popitem(last=False)
        self._free(request_id)

    def _free(self, request_id: str) -> bool:
        """Abort a request whose KV was being received: its pages are freed (and lent pages
        it copied from given back) only once the writes already issued have landed."""
        self.kv_cache.wait_writes()
        self.notices.forget(request_id)
        return self._engine().abort(request_id)

    async def _receive(self, store, task: DecodeTask, pages: list[int], reservation) -> None:
        """Copy the prompt's KV into `pages`, then join the batch once the first token is
        known (the join's own error is kept for `generate`)."""
        units = self._plan_transfer(task.request_id, task.token_ids, task.block_keys)
        await self.receiver.receive(
            store, task.request_id, units, pages, task.store_name, reservation
        )
        # The KV is in: from now on, a hand-off is due within handoff_timeout_s.
        asyncio.get_running_loop().call_later(
            self.handoff_timeout_s, self._expire, task.request_id, asyncio.current_task()
        )
        await self._join(task.request_id, reservation)

    async def _join(self, request_id: str, reservation: Reservation) -> None:
        token = reservation.first_token
        if not token.done():
            await token
        if self.receives.get(request_id) is asyncio.current_task():
            self.num_early_joins += 1  # joining before the router's hand-off (`generate`)
        self.receiver.timings_of(request_id).joined_at = time.time()
        try:
            await self._engine().join(request_id, token.result())
        except HalfmoonError as error:
            reservation.join_error = error

    def _take_transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds from reservation to last layer) of each KV receive since last call."""
        return self.receiver.take_transfers()

    async def receive_timings(self, request_id: str) -> ReceiveTimings | None:
        return self.receiver.timings_of(request_id)


async def _received(request_id: str, receive: asyncio.Task, timeout_s: float) -> WorkerError | None:
    """Wait (up to `timeout_s`, `store.get_timeout_s`) for the request's KV to be in; why it
    is not, or None."""
    try:
        await asyncio.wait_for(receive, timeout_s)
    except asyncio.CancelledError:
        return aborted(request_id)
    except TimeoutError:
        return WorkerError(
            "UNAVAILABLE",
            f"the KV of {request_id} was not all in the store {timeout_s} s after "
            "its prefill ended (store.get_timeout_s)",
            retryable=True,
        )
    except Exception as error:  # noqa: BLE001 - the router learns why, as data
        return WorkerError(
            "UNAVAILABLE", f"receiving the KV of {request_id} failed: {error}", retryable=True
        )
    return None


async def _as_data(
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[RequestOutput | WorkerError]:
    """The outputs, with a halfmoon error at the end turned into a last `WorkerError` item."""
    async with contextlib.aclosing(outputs):
        try:
            async for out in outputs:
                yield out
        except HalfmoonError as error:
            yield WorkerError.of(error)


async def _timed(
    outputs: AsyncIterator[RequestOutput | WorkerError], called_at: float
) -> AsyncIterator[RequestOutput | WorkerError]:
    """The outputs, the first with the worker's stages added to its timeline (when the call
    began here, when it left); the others without one, as the trace reads only the first."""
    first = True
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            if isinstance(out, RequestOutput):
                if first:
                    out.timeline = (
                        ("call began on the worker", called_at),
                        *out.timeline,
                        ("first output left the worker", time.time()),
                    )
                    first = False
                else:
                    out.timeline = ()
            yield out
