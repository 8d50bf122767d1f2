"""The decode worker: reserves pages, pulls each layer of a prompt's KV from the store as it
lands, then decodes the request in its continuous batch and streams the tokens back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

import ray

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import LLMEngine, RequestOutput
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.worker_base import EngineWorker
from halfmoon.engine.worker_errors import WorkerError, aborted
from halfmoon.kvstore.locate import local_store
from halfmoon.kvstore.shared_arena import MappedArena, map_arena
from halfmoon.kvstore.transfer import plan_transfer

log = logging.getLogger(__name__)
RECENT_TIMINGS = 1024
# Until the router hands the request over (its prefill returned), the reads wait for the
# prefill however long it queues and computes, up to this bound: the router aborts the
# reservation when the prefill fails or its worker dies. After the hand-off, what is still
# missing must land within `get_timeout_s`.
PREFILL_WAIT_S = 3600.0
# A reservation whose KV has landed (or whose receive failed) and that no `generate` claims
# within this many seconds is freed: the router that made it died or lost track of it. The
# router hands over as soon as its prefill returns, a moment before its last layers land.
HANDOFF_TIMEOUT_S = 60.0
# Ids of reservations freed that way, kept so a late `generate` says why it finds none.
EXPIRED_IDS = 1024


@dataclasses.dataclass(slots=True)
class ReceiveTimings:
    """When a request's KV arrived (wall-clock seconds since epoch)."""

    reserved_at: float
    first_layer_received_at: float = 0.0
    all_received_at: float = 0.0
    joined_at: float = 0.0
    num_bytes: int = 0


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
    ):
        super().__init__(name, LLMEngine(config))
        self.store = store
        self.get_timeout_s = get_timeout_s
        self.handoff_timeout_s = handoff_timeout_s
        self.expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired_reservations = 0
        self.chunk_tokens = config.prefill_chunk_size or config.max_num_batched_tokens
        self.receives: dict[str, asyncio.Task] = {}  # reserved, not handed over yet
        # Handed over (`generate` waits for the last layer): whoever takes a receive out of
        # here (`generate` or `abort`) frees its pages, so a retry's later reservation under
        # the same request id is never freed or joined by the attempt it replaced.
        self.joining: dict[str, asyncio.Task] = {}
        self.stores: dict[str, object] = {}
        self.arenas: dict[object, MappedArena | None] = {}  # by store handle, mapped once
        self.num_shared_reads = 0
        self.transfers: list[tuple[int, float]] = []  # (bytes, seconds) of finished receives
        self.timings: OrderedDict[str, ReceiveTimings] = OrderedDict()

    def _extra_counters(self) -> dict:
        return {
            "num_receiving": len(self.receives) + len(self.joining),
            "num_expired_reservations": self.num_expired_reservations,
            "num_shared_reads": self.num_shared_reads,
        }

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        store_name: str | None = None,
        ticket: str | None = None,
    ) -> int | WorkerError:
        """Hold pages for the prompt and start pulling its KV from the store node the prefill
        worker publishes to (`store_name`; default: ours); returns the pages held. A reserve
        whose `ticket` was aborted already holds nothing."""
        if self._was_aborted(ticket):
            return aborted(request_id)
        try:
            store = self._store(store_name)
            pages = self._engine().reserve(prompt_token_ids, params, request_id)
        except HalfmoonError as error:
            return WorkerError.of(error)
        units = plan_transfer(
            self.engine.root_key,
            prompt_token_ids,
            self.engine.config.block_size,
            self.chunk_tokens,
            request_id,
        )
        self._record(request_id, ReceiveTimings(reserved_at=time.time()))
        receive = asyncio.create_task(self._receive(store, request_id, units, pages, store_name))
        receive.add_done_callback(lambda task: self._await_handoff(request_id, task))
        self.receives[request_id] = receive
        return len(pages)

    async def generate(
        self, request_id: str, first_token_id: int
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Wait for the last layer, join the batch, and stream the request's outputs; a
        failure is the last item, as a `WorkerError`."""
        called_at = time.time()
        receive = self.receives.pop(request_id, None)
        if receive is None and request_id in self.expired:
            yield WorkerError(
                "UNAVAILABLE",
                f"the reservation of {request_id} was freed: nothing claimed it "
                f"{self.handoff_timeout_s:g} s after its KV landed",
                retryable=True,
            )
            return
        if receive is None:
            yield WorkerError("NOT_FOUND", f"request {request_id} has no reservation here")
            return
        engine = self._engine()
        self.joining[request_id] = receive
        failure = None
        try:
            await asyncio.wait_for(receive, self.get_timeout_s)
        except asyncio.CancelledError:
            failure = aborted(request_id)
        except TimeoutError:
            failure = WorkerError(
                "UNAVAILABLE",
                f"the KV of {request_id} was not all in the store {self.get_timeout_s} s after "
                "its prefill ended (store.get_timeout_s)",
                retryable=True,
            )
        except Exception as error:  # noqa: BLE001 - the router learns why, as data
            failure = WorkerError(
                "UNAVAILABLE", f"receiving the KV of {request_id} failed: {error}", retryable=True
            )
        if self.joining.get(request_id) is not receive:  # `abort` took it (and freed it)
            yield aborted(request_id)
            return
        del self.joining[request_id]
        if failure is not None:
            self._free(request_id)
            yield failure
            return
        self.timings[request_id].joined_at = time.time()
        try:
            engine.join(request_id, first_token_id)
        except HalfmoonError as error:
            yield WorkerError.of(error)
            return
        async for out in _timed(_as_data(engine.stream(request_id)), called_at):
            yield out

    async def generate_colocated(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        ticket: str | None = None,
    ) -> AsyncIterator[RequestOutput | WorkerError]:
        """Prefill and decode here (colocated mode and short-prompt bypass)."""
        called_at = time.time()
        if self._was_aborted(ticket):
            yield aborted(request_id)
            return
        outputs = _as_data(self._engine().generate(prompt_token_ids, params, request_id))
        async for out in _timed(outputs, called_at):
            yield out

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the request here and free its pages; a reserve or colocated call with the same
        `ticket` that lands later is refused."""
        self._remember_abort(ticket)
        receive = self.receives.pop(request_id, None) or self.joining.pop(request_id, None)
        if receive is not None:
            receive.cancel()
            return self._free(request_id)
        return self._engine().abort(request_id)

    def _await_handoff(self, request_id: str, receive: asyncio.Task) -> None:
        """The receive ended: free its pages unless `generate` or `abort` claims it within
        `handoff_timeout_s` (its router died between the reserve and the hand-off)."""
        if receive.cancelled() or self.receives.get(request_id) is not receive:
            return  # aborted, or already handed over
        loop = asyncio.get_running_loop()
        loop.call_later(self.handoff_timeout_s, self._expire, request_id, receive)

    def _expire(self, request_id: str, receive: asyncio.Task) -> None:
        if self.receives.get(request_id) is not receive:
            return
        del self.receives[request_id]
        failure = receive.exception()  # retrieved, so asyncio does not log it as lost
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
        """Abort a request whose KV was being received: its pages are freed only once the
        writes already issued into them have landed."""
        self.engine.kv.wait_writes()
        return self._engine().abort(request_id)

    async def drain_transfers(self) -> list[tuple[int, float]]:
        """(bytes, seconds from reservation to last layer) of each KV receive since last call."""
        transfers, self.transfers = self.transfers, []
        return transfers

    async def receive_timings(self, request_id: str) -> ReceiveTimings | None:
        return self.timings.get(request_id)

    def _store(self, name: str | None):
        if name is None:
            return self.store if self.store is not None else local_store()
        if name not in self.stores:
            self.stores[name] = ray.get_actor(name)
        return self.stores[name]

    async def _arena(self, store, store_name: str | None) -> MappedArena | None:
        """The store node's shared arena, when it is on this node (mapped once per store)."""
        key = store_name or id(store)
        if key not in self.arenas:
            info = await store.arena_info.remote()
            self.arenas[key] = map_arena(info, ray.get_runtime_context().get_node_id())
        return self.arenas[key]

    async def _receive(
        self, store, request_id: str, units, pages: list[int], store_name: str | None = None
    ) -> None:
        kv_cache = self.engine.kv
        timings = self.timings[request_id]
        arena = await self._arena(store, store_name)
        # One stream for the whole prompt: the store sends each layer of each unit as soon as
        # it is put, so a prompt whose KV is all published costs one round trip, and the
        # store holds one call for this request however many units and layers it has. On
        # the store's own node it sends only where the layer is in its shared arena, and
        # the layer is copied from there (no Ray object carries it).
        method = store.stream_layers if arena is None else store.stream_slots
        extra = () if arena is None else (f"{request_id}/{uuid.uuid4().hex}",)
        stream = method.options(num_returns="streaming").remote(
            [unit.keys for unit in units],
            kv_cache.num_layers,
            max(self.get_timeout_s, PREFILL_WAIT_S),
            *extra,
        )
        written = None  # the last layer write: on CUDA it lands after it is issued
        try:
            for unit in units:
                unit_pages = pages[unit.first_block : unit.first_block + len(unit.keys)]
                for layer in range(kv_cache.num_layers):
                    item = await (await anext(stream))
                    if arena is None:
                        kv = item
                    else:
                        slots, _ = item  # the stream's leases end with end_stream
                        kv = arena.read(slots, layer, pin=kv_cache.device.type == "cuda")
                        self.num_shared_reads += 1
                    written = kv_cache.write_layer(layer, unit_pages, kv, ordered=False)
                    timings.num_bytes += kv.nbytes
                    if not timings.first_layer_received_at:
                        timings.first_layer_received_at = time.time()
        except BaseException:
            ray.cancel(stream)  # aborted or failed: the store stops waiting for the rest
            raise
        finally:
            if extra:  # the layers are copied out (or never will be): the slots may go
                store.end_stream.remote(*extra)
        if written is not None and not written.done():  # writes land in order: the last says all
            await asyncio.to_thread(written.wait)
        timings.all_received_at = time.time()
        self.transfers.append((timings.num_bytes, timings.all_received_at - timings.reserved_at))

    def _record(self, request_id: str, timings: ReceiveTimings) -> None:
        self.timings[request_id] = timings
        while len(self.timings) > RECENT_TIMINGS:
            self.timings.popitem(last=False)


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
