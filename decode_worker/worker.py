"""The decode worker: reserves pages, pulls each layer of a prompt's KV from the store as it
lands (or, on the prefill worker's node, copies it out of the prefill worker's own pages or
the store's shared arena when the prefill worker says it is there), joins the request to its
continuous batch as soon as the last layer and the first token are in, and streams the tokens
back.

The actor takes `DecodeTask`s and names each attempt by its ticket (its request id when a
task has none), in its engine too. Beside it: each receive's record and the registry of them
(receives.py), their life from reserve to end (handoff.py), the copy-in (receive.py), the
notices from prefill workers on this node (notices.py) and the transfer engine's grants from
those on other nodes (engine_receive.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import ray

from halfmoon.cluster.worker.actor import EngineWorker
from halfmoon.cluster.worker.errors import WorkerError, aborted
from halfmoon.decode_worker.engine_receive import EngineReceiver
from halfmoon.decode_worker.handoff import HANDOFF_TIMEOUT_S, Handoffs
from halfmoon.decode_worker.notices import EARLY_NOTICE_S, Notices
from halfmoon.decode_worker.receive import Receiver
from halfmoon.decode_worker.receives import Receives, ReceiveTimings
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import LLMEngine, RequestOutput
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.locate import local_store_name
from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.kvstore.transfer.staging import Grant


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
        kv_cache = self.engine.kv_cache
        self.receives = Receives()
        self.notices = Notices(kv_cache, self.receives, store, early_notice_s)
        engine = EngineReceiver(kv_cache, self.receives, transfer or TransferSettings())
        self.receiver = Receiver(kv_cache, self.notices, store, get_timeout_s, engine)
        self.handoffs = Handoffs(
            self._engine,
            self.receives,
            self.notices,
            self.receiver,
            get_timeout_s,
            handoff_timeout_s,
        )

    def _extra_counters(self) -> dict:
        return self.handoffs.counters() | self.receiver.counters() | self.notices.counters()

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
        if self.receives.refused(task.ticket):
            return aborted(task.request_id)
        key = task.ticket or task.request_id
        try:
            store = self.receiver.store_named(task.store_name)
            pages, fence = await self._engine().reserve(
                task.token_ids,
                task.params,
                key,
                task.block_keys,
                num_prior_output_tokens=task.num_prior_output_tokens,
            )
        except HalfmoonError as error:
            return WorkerError.of(error)
        direct = task.direct and self.notices.listening
        receive = self.receives.open(
            task.request_id, key, len(task.token_ids), direct, task.first_token_id
        )
        receive.fence = fence  # on the step thread: the pages' last readers are before it
        self.notices.adopt(receive)
        if task.direct and task.store_name not in (None, local_store_name()):
            self.receiver.engine.expect(receive)  # its prefill worker is on another node
        units = self._plan_transfer(task.request_id, task.token_ids, task.block_keys)
        self.handoffs.start(receive, store, units, pages, task.store_name)
        return len(pages)

    async def generate(
        self, ticket: str, first_token_id: int | list[int]
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """The router's hand-off of the reserved attempt `ticket` (its request id when the
        reserve had none): wait for the last layer, join the batch after the first token (with
        `n` > 1 a list, one per sequence: the request forks into them here), and stream the
        request's outputs; a failure is the last item, as a `WorkerError`."""
        called_at = time.time()
        failure = await self.handoffs.hand_over(ticket, first_token_id)
        if failure is not None:
            yield failure
            return
        async for out in _timed(_as_data(self._engine().stream(ticket)), called_at):
            yield out

    async def generate_colocated(
        self, task: DecodeTask
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Prefill and decode here (colocated mode and short-prompt bypass)."""
        called_at = time.time()
        if self.receives.refused(task.ticket):
            yield aborted(task.request_id)
            return
        outputs = self._engine().generate(
            task.token_ids,
            task.params,
            task.ticket or task.request_id,
            task.block_keys,
            num_prior_output_tokens=task.num_prior_output_tokens,
        )
        async for out in _timed(_as_data(outputs), called_at):
            yield out

    def _held_request_ids(self) -> set[str]:
        return {receive.key for receive in self.receives}

    def _forget_store(self, name: str) -> None:
        self.receiver.forget_store(name)
        self.notices.forget_store(name)

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the attempt `ticket` (or `request_id`, when none) and free its pages; a reserve
        or colocated call with the same `ticket` that lands later is refused."""
        self.notices.abort(request_id, ticket)
        key = ticket or request_id
        freed = self.handoffs.abort(key)
        return self._engine().abort(key) if freed is None else freed

    def _take_transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds from reservation to last layer) of each KV receive since last call."""
        return self.receiver.take_transfers()

    async def receive_timings(self, name: str) -> ReceiveTimings | None:
        """When the KV of a recent attempt arrived: attempt `name` (its ticket), else the latest
        of request `name` (the last few thousand are kept)."""
        receive = self.receives.find(name)
        return None if receive is None else receive.timings


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
