"""The prefill worker: loads a cached prefix, computes the rest in chunks, and publishes
each layer of each chunk to the KV store as soon as that layer is computed.

With `EngineConfig.share_kv` it also lends its own pages (the device tier) to a decode worker
on its node: it tells it where each layer is in its KV cache, before the store has a copy,
and holds those pages until the decode worker answers that it has copied them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import ray

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.sequence import Sequence, TokenLogprobs
from halfmoon.engine.worker_base import EngineWorker
from halfmoon.engine.worker_errors import WorkerError, aborted
from halfmoon.kvstore.index import BlockEvent
from halfmoon.kvstore.kv_notices import (
    KvPeer,
    LayerNotice,
    NoticeSender,
    PagesNotice,
    ReleaseNotice,
    TokenNotice,
)
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.locate import local_store, local_store_name
from halfmoon.kvstore.shared_arena import MappedArena, map_arena
from halfmoon.kvstore.transfer import TransferUnit, plan_transfer
from halfmoon.prefill_worker.warm import adopt_blocks

log = logging.getLogger(__name__)
RECENT_REQUESTS = 1024
# Blocks warmed per engine call: bounds the memory in flight and the pause of the step loop.
WARM_CHUNK_BLOCKS = 64
# Pages lent to a decode worker that has not answered this long after they were all sent go
# back with a warning (it answers within milliseconds; its connection ending frees them too).
LEND_TIMEOUT_S = 300.0
# How long the publisher waits for the lender thread to offer a layer's pages before it sends
# the layer's slots notice anyway (the decode worker then takes whichever came first).
OFFER_WAIT_S = 1.0


@dataclass(slots=True)
class PrefillResult:
    """The first token and where the prefill's time went (wall-clock seconds since epoch)."""

    request_id: str
    first_token_id: int
    logprobs: TokenLogprobs | None
    num_prompt_tokens: int
    num_local_cached_tokens: int
    num_loaded_tokens: int
    arrived_at: float
    started_at: float
    computed_at: float  # the engine produced the first token
    finished_at: float  # the call returned (its last layers may still be on their way)
    last_layer_published_at: float


@dataclass(slots=True)
class _PrefixLoad:
    """A stored prefix on its way into our pages: each layer copied out of the store's
    shared arena (`slots`, held by `lease_id`) when the store is on this node and holds all
    of it, else one ObjectRef per layer (`layers`) of the store's `get_layer`."""

    first_block: int
    pages: list[int]
    layers: list | None = None
    slots: list[int] | None = None
    lease_id: int = 0


@dataclass(slots=True)
class _Job:
    units: list[TransferUnit]
    key: str = ""  # what the decode worker's notices name the receive by: ticket or request id
    peer: KvPeer | None = None  # the decode worker to notify directly, when on this node
    next_unit: int = 0
    store_blocks: int = 0
    lease_id: int | None = None
    load: _PrefixLoad | None = None
    layerwise: bool = True
    arena_loads: bool = True
    num_loaded_tokens: int = 0
    puts: list = field(default_factory=list)
    # Per unit (by its first key), on the shared-arena path: its slots and the claim's lease.
    claims: dict = field(default_factory=dict)
    # Per unit (by its index), layers in the arena the store has not been told of yet: with
    # direct notices it is told once per unit, after the last layer (it only caches them).
    unreported: dict = field(default_factory=dict)
    last_layer_published_at: float = 0.0
    started_at: float = 0.0
    # Lending its pages to `peer` (the device tier): the pages held so far, and whether the
    # decode worker and the publisher are done with them (they are given back when both are).
    lends: bool = False
    lent_key: tuple[str, str] = ("", "")
    held: list[int] = field(default_factory=list)
    decode_done: bool = False
    publisher_done: bool = False
    offering: bool = True


@dataclass(slots=True)
class _LayerOut:
    """For the publisher: one layer of one transfer unit, snapshotted off the pages, or, when
    the job lends its pages, read from them by the publisher (`pages`, held; `ready`: on CUDA
    the event after which the layer is in them)."""

    job: _Job
    unit: int  # its index in the job's plan
    layer: int
    snapshot: object = None  # HostLayer: `wait()` gives the LayerKV
    pages: list[int] | None = None
    ready: object = None
    # Set by the lender thread once the page notice is sent (or will not be): the slots
    # notice goes after it, so the decode worker sees the pages first.
    offered: threading.Event | None = None

    @property
    def keys(self) -> list[bytes]:
        return self.job.units[self.unit].keys


@dataclass(slots=True)
class _TokenOut:
    """For the publisher: tell the decode worker the first token (after the layers before)."""

    job: _Job
    token_id: int


@dataclass(slots=True)
class _EndOut:
    """For the publisher: the job's prefill call ended; nothing more of it follows."""

    job: _Job


@dataclass(slots=True)
class _FlushOut:
    """For the publisher: `done` is set once everything queued before it was sent."""

    done: concurrent.futures.Future


class PrefillWorker(EngineWorker, KVHooks):
    """Prefill-only engine; its KV goes layer by layer to the store for the decode worker."""

    kind = "prefill"

    def __init__(self, name: str, config: EngineConfig, store=None, get_timeout_s: float = 30.0):
        if config.prefill_chunk_size is None:
            raise ValueError("a prefill worker needs EngineConfig.prefill_chunk_size")
        super().__init__(name, LLMEngine(config, hooks=self))
        self.store = store
        self.get_timeout_s = get_timeout_s
        self.chunk_tokens = config.prefill_chunk_size
        self.jobs: dict[str, _Job] = {}
        self.num_loaded_tokens = 0
        self.engine.record_page_events()
        self.published_at: OrderedDict[str, float] = OrderedDict()
        # Puts still in flight after a prefill returned, by its ticket (or request id).
        self.flushes: dict[str, asyncio.Task] = {}
        self.failed_flushes: OrderedDict[str, str] = OrderedDict()  # recent ones, and why
        self.num_failed_flushes = 0
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.arena: MappedArena | None = None  # the store's arena, mapped on first publish
        self.arena_checked = False
        self.num_shared_writes = 0
        self.num_store_reports = 0  # `layer_written` calls: one per unit with direct notices
        self.num_arena_loads = 0  # layers of stored prefixes copied out of the arena
        self.node = ray.get_runtime_context().get_node_id()
        # Lend pages only where a decode worker can open them: a named actor (it looks us up),
        # a cache allocated to be shared.
        # Made now, before the step thread runs: a decode worker's first request waits on it.
        actor_name = ray.get_runtime_context().get_actor_name() or None
        lendable = config.share_kv and actor_name
        self._export = self.engine.kv.export() if lendable else None
        self.lends = self._export is not None
        self.lent: dict[tuple[str, str], _Job] = {}  # by (decode worker's socket, receive key)
        self.lend_lock = threading.Lock()
        self.num_page_notices = 0
        self.num_reclaimed_lends = 0
        # Used by the publisher thread only; the answers are read in the event loop.
        self.notices = NoticeSender(actor_name if self.lends else None, self._on_answer)
        self.num_failed_notices = 0
        threading.Thread(target=self._send_forever, name="kv-publisher", daemon=True).start()
        # Lent layers are announced by their own thread, ahead of the publisher's copies for
        # the store (which only feed the cache on this path).
        self.lend_queue: queue.SimpleQueue = queue.SimpleQueue()
        if self.lends:
            threading.Thread(target=self._lend_forever, name="kv-lender", daemon=True).start()

    def _store(self):
        # Our own node's store, found on first use: it is started after the workers.
        if self.store is None:
            self.store = local_store()
        return self.store

    async def store_name(self) -> str:
        """Name of the store node this worker publishes to (decode pulls from it)."""
        return local_store_name()

    def _extra_counters(self) -> dict:
        return {
            "num_loaded_tokens": self.num_loaded_tokens,
            "forward_s": self.engine.runner.forward_s,
            "num_flushing": len(self.flushes),
            "num_shared_writes": self.num_shared_writes,
            "num_store_reports": self.num_store_reports,
            "num_arena_loads": self.num_arena_loads,
            "num_direct_notices": self.notices.num_sent,
            "num_page_notices": self.num_page_notices,
            "num_lent_pages": self.engine.pool.num_held_pages,  # drained by `counters`' stats
            "num_reclaimed_lends": self.num_reclaimed_lends,
            "num_failed_notices": self.num_failed_notices,
            "num_failed_flushes": self.num_failed_flushes,
        }

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        layerwise: bool = True,
        ticket: str | None = None,
        kv_peer: KvPeer | None = None,
        lend: bool = True,
        arena_loads: bool = True,
    ) -> PrefillResult | WorkerError:
        """Compute the prompt's KV, publish it, and return the first token (a `WorkerError`
        when it fails or was aborted: `ticket` names this call for `abort`). It returns as
        soon as the first token is computed: the last layers' puts finish in the background
        (the decode worker's reads wait for them), so the first token never waits for them.

        `kv_peer`: the decode worker that reserved the request (with `direct=True`). When it
        is on this node and the layers go through the store's shared arena, it is told of
        each layer and of the first token straight away (kvstore/kv_notices.py), and it
        releases each unit's claim once it has copied it. When this worker lends its pages
        (and `lend`), it is first told where each layer is in them (the module's docstring).

        With `layerwise=False` the KV is sent only after the whole prompt is computed (the
        baseline the transfer benchmark compares against); with `arena_loads=False` a stored
        prefix is read as Ray objects even from this node's store (the prefix-load
        benchmark's baseline)."""
        arrived_at = time.time()
        engine = self._engine()
        job = _Job(
            plan_transfer(
                self.engine.root_key,
                prompt_token_ids,
                self.engine.config.block_size,
                self.chunk_tokens,
                request_id,
            )
        )
        job.layerwise = layerwise
        job.arena_loads = arena_loads
        job.key = ticket or request_id
        job.peer = kv_peer if kv_peer is not None and kv_peer.node_id == self.node else None
        if job.peer is not None and self.lends and lend:
            job.lends = True
            job.lent_key = (job.peer.path, job.key)
            self.notices.loop = asyncio.get_running_loop()
            with self.lend_lock:
                self.lent[job.lent_key] = job
        self._store()
        await self._find_stored_prefix(job, len(prompt_token_ids))
        self.jobs[request_id] = job
        first = dataclasses.replace(
            params, max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True
        )
        try:
            if self._was_aborted(ticket):  # aborted while the prefix lookup was in flight
                return aborted(request_id)
            last = None
            async for out in engine.generate(prompt_token_ids, first, request_id):
                last = out
            if last.finish_reason == "abort":
                return aborted(request_id)
            computed_at = time.time()
        except HalfmoonError as error:
            return WorkerError.of(error)
        finally:
            self.jobs.pop(request_id, None)
            if job.lease_id is not None:  # the loaded prefix is in our pages by now
                self.store.release.remote(job.lease_id)
            if job.lends:  # after the job's last layer: its pages can go once read
                self.outbox.put(_EndOut(job))
        self._flush_later(ticket or request_id, job)
        return PrefillResult(
            request_id=request_id,
            first_token_id=last.new_token_ids[0],
            logprobs=last.new_logprobs[0] if last.new_logprobs else None,
            num_prompt_tokens=len(prompt_token_ids),
            num_local_cached_tokens=last.num_cached_tokens - job.num_loaded_tokens,
            num_loaded_tokens=job.num_loaded_tokens,
            arrived_at=arrived_at,
            started_at=job.started_at or arrived_at,
            computed_at=computed_at,
            finished_at=time.time(),
            last_layer_published_at=job.last_layer_published_at,
        )

    async def kv_export(self):
        """How a decode worker on this node opens this worker's KV cache to copy lent pages
        from (`engine/kv_cache.py`); None when this worker does not lend them."""
        return self._export

    async def warm(self, block_keys: list[bytes], store_name: str | None = None) -> int:
        """Load the stored KV of the prefix chain `block_keys` from the store node `store_name`
        (default: this node's) into this worker's own pages as cached prefix pages, so later
        requests with that prefix hit locally. Returns how many blocks were added."""
        if not self.engine.pool.enable_caching:
            return 0
        engine = self._engine()
        keys = engine.call(lambda e: e.pool.uncached(list(block_keys)))
        store = ray.get_actor(store_name) if store_name else self._store()
        held = await store.cached_prefix.remote(keys)
        if not held:
            return 0
        lease_id = await store.lease.remote(keys[:held])
        adopted = 0
        try:
            for first in range(0, held, WARM_CHUNK_BLOCKS):
                chunk = keys[first : min(first + WARM_CHUNK_BLOCKS, held)]
                layers = await asyncio.gather(
                    *[
                        store.get_layer.remote(chunk, layer, self.get_timeout_s)
                        for layer in range(self.engine.model_config.num_layers)
                    ]
                )
                adopted += engine.call(lambda e, c=chunk, kv=layers: adopt_blocks(e, c, kv))
        finally:
            store.release.remote(lease_id)
        return adopted

    async def stored(self, request_id: str, ticket: str | None = None) -> bool | WorkerError:
        """Wait until the KV of the prefill `ticket` (or `request_id`) returned is all in the
        store: True (at once when it is, or for a call this worker does not know), or a
        retryable `WorkerError` when storing it failed. The router awaits this beside the
        decode worker's first output, so a prefill worker that dies (the call then fails at
        once) or fails before its last layers are stored ends the attempt right away, instead
        of the decode worker waiting `store.get_timeout_s` for layers that will never come."""
        name = ticket or request_id
        flush = self.flushes.get(name)
        if flush is not None:
            await asyncio.wait([flush])  # its outcome is read below, from the record
        why = self.failed_flushes.get(name)
        if why is None:
            return True
        return WorkerError("UNAVAILABLE", f"storing the KV of {request_id} failed: {why}", True)

    async def publish_time(self, request_id: str) -> float | None:
        """When the last layer of the last chunk of a recent request was published."""
        return self.published_at.get(request_id)

    def _remember(self, request_id: str, published_at: float) -> None:
        self.published_at[request_id] = published_at
        while len(self.published_at) > RECENT_REQUESTS:
            self.published_at.popitem(last=False)

    async def drain_events(self) -> list[BlockEvent]:
        """Blocks that entered or left this worker's own pages (the device tier) since last call."""
        events = self._engine().call(LLMEngine.take_page_events)
        return [BlockEvent(kind, self.name, "device", [key]) for kind, key in events]

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the request's prefill; a `prefill` call with the same `ticket` that lands later
        is refused."""
        self._remember_abort(ticket)
        return self._engine().abort(request_id)

    async def _find_stored_prefix(self, job: _Job, num_tokens: int) -> None:
        # The plan already holds every full block's key (a partial tail's key is private).
        keys = _plan_keys(job)[: num_tokens // self.engine.config.block_size]
        hit = await self.store.cached_prefix.remote(keys)
        if hit:
            job.store_blocks = hit
            job.lease_id = await self.store.lease.remote(keys[:hit])

    # KVHooks: called from the engine's step thread.

    def external_prefix_blocks(self, seq: Sequence, first_block: int, max_blocks: int) -> int:
        job = self.jobs.get(seq.request_id)
        return 0 if job is None else min(max_blocks, max(0, job.store_blocks - first_block))

    def load_prefix(self, seq: Sequence, first_block: int, pages: list[int]) -> None:
        job = self.jobs[seq.request_id]
        keys = _plan_keys(job)[first_block : first_block + len(pages)]
        held = None
        if job.arena_loads and self._arena() is not None:
            try:  # one round trip, instead of a Ray object per layer
                held = ray.get(self.store.lease_slots.remote(keys), timeout=self.get_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as error:
                log.warning("leasing a stored prefix's arena slots failed: %s", error)
        if held is not None:
            job.load = _PrefixLoad(first_block, pages, slots=held[0], lease_id=held[1])
            return
        refs = [
            self.store.get_layer.remote(keys, layer, self.get_timeout_s)
            for layer in range(self.engine.model_config.num_layers)
        ]
        job.load = _PrefixLoad(first_block, pages, layers=refs)

    def before_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            job = self.jobs.get(item.seq.request_id)
            if job is not None and not job.started_at:
                job.started_at = time.time()
            if job is None or job.load is None:
                continue
            load = job.load
            if load.slots is not None:
                cuda = self.engine.kv.device.type == "cuda"
                kv = self.arena.read(load.slots, layer, pin=cuda)
                self.num_arena_loads += 1
            else:
                kv: LayerKV = ray.get(load.layers[layer])
            self.engine.kv.write_layer(layer, load.pages, kv)
            if layer == self.engine.model_config.num_layers - 1:
                if load.slots is not None:  # copied out: the slots may go
                    self.store.release.remote(load.lease_id)
                loaded = len(load.pages) * self.engine.config.block_size
                job.num_loaded_tokens += loaded
                self.num_loaded_tokens += loaded
                job.load = None

    def after_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        num_layers = self.engine.model_config.num_layers
        last_layer = layer == num_layers - 1
        for item in batch:
            job = self.jobs.get(item.seq.request_id)
            if job is None:
                continue
            end = item.seq.num_computed_tokens + item.num_new_tokens
            if job.layerwise:
                ready = [u for u in job.units[job.next_unit :] if u.end_token <= end]
                for index in range(job.next_unit, job.next_unit + len(ready)):
                    self._publish(job, item.seq, index, layer)
            elif last_layer and end == len(item.seq):
                ready = job.units
                for each_layer in range(num_layers):
                    for index in range(len(ready)):
                        self._publish(job, item.seq, index, each_layer)
            else:
                continue
            if last_layer and ready:
                job.next_unit += len(ready)
                if job.next_unit == len(job.units):
                    job.last_layer_published_at = time.time()
                    self._remember(item.seq.request_id, job.last_layer_published_at)

    def sampled(self, seq: Sequence, token_id: int) -> None:
        """The first token, to the decode worker told directly, from the step that sampled it
        (the decode worker joins once it and every layer are in, in either order): sent from
        here when that cannot wait, else by a publishing thread."""
        job = self.jobs.get(seq.request_id)
        if job is None or job.peer is None:
            return
        if not self.notices.try_send(job.peer, TokenNotice(job.key, token_id)):
            (self.lend_queue if job.lends else self.outbox).put(_TokenOut(job, token_id))

    def _publish(self, job: _Job, seq: Sequence, index: int, layer: int) -> None:
        unit = job.units[index]
        pages = seq.block_table[unit.first_block : unit.first_block + len(unit.keys)]
        if job.lends:  # held from the unit's first layer; the publisher reads them itself
            if layer == 0:
                self.engine.pool.hold(pages)
                with self.lend_lock:
                    job.held.extend(pages)
            ready = self.engine.kv.mark()
            item = _LayerOut(job, index, layer, pages=pages, ready=ready, offered=threading.Event())
            self.lend_queue.put(item)  # the same item for both threads: see `offered`
            self.outbox.put(item)
            return
        # Snapshot the pages here (a small copy); the publisher thread does the slow send.
        snapshot = self.engine.kv.read_layer(layer, pages)
        self.outbox.put(_LayerOut(job, index, layer, snapshot))

    def _send_forever(self) -> None:
        """Publisher thread: hands snapshots to the store so the step loop never waits on it.
        One `put_layer` call per snapshot: batching the backlog into one call was measured
        slower (its serialization holds the GIL longer against the step thread)."""
        while True:
            item = self.outbox.get()
            if isinstance(item, _FlushOut):
                item.done.set_result(None)  # everything queued before it is sent
                continue
            if isinstance(item, _TokenOut):
                self._notify(item.job, TokenNotice(item.job.key, item.token_id))
                continue
            if isinstance(item, _EndOut):
                self._lend_done(item.job, publisher=True)
                continue
            try:
                put = self._send(item)
                if put is not None:
                    item.job.puts.append(put)
            except Exception as error:  # noqa: BLE001 - the thread must live; the flush fails
                log.exception("publishing a KV snapshot of %d blocks failed", len(item.keys))
                item.job.puts.append(_failed(error))

    def _lend_forever(self) -> None:
        """Lender thread: tells the decode worker of each lent layer as soon as it is in our
        pages (on CUDA, once its compute has run), and then of the first token."""
        while True:
            item = self.lend_queue.get()
            job = item.job
            try:
                if isinstance(item, _TokenOut):
                    self._notify(job, TokenNotice(job.key, item.token_id))
                    continue
                if item.ready is not None:
                    item.ready.synchronize()  # the layer is in the pages before anyone reads them
                if job.peer is not None and job.offering and not job.decode_done:
                    notice = PagesNotice(job.key, item.unit, item.layer, tuple(item.pages))
                    if self._notify(job, notice):
                        self.num_page_notices += 1
            except Exception:  # noqa: BLE001 - the thread must live; the arena's copy stays
                log.exception("offering lent pages of %s failed", job.key)
                # Nothing more is offered (the decode worker takes the arena's copies); what
                # was offered stays held until it answers.
                job.offering = False
            finally:
                if isinstance(item, _LayerOut):
                    item.offered.set()

    def _send(self, item: _LayerOut):
        """Send one layer of some blocks to the store; returns the store call's ObjectRef
        (None: the store is told later, see `_write_shared`).
        A lent layer is read from the (held) pages here, off the step thread."""
        if item.pages is None:
            kv = item.snapshot.wait()
        else:
            kv = self.engine.kv.read_layer(item.layer, item.pages, after=item.ready).wait()
        arena = self._arena()
        if arena is None:
            return self.store.put_layer.remote(item.keys, item.layer, kv)
        return self._write_shared(arena, item, kv)

    def _arena(self) -> MappedArena | None:
        """The store node's shared arena, mapped once (None: it is elsewhere or private, and
        layers go through `put_layer`)."""
        if not self.arena_checked:  # the step thread and the publisher may both map it once
            info = ray.get(self.store.arena_info.remote())
            self.arena = map_arena(info, ray.get_runtime_context().get_node_id())
            self.arena_checked = True  # after `arena`: a thread seeing it sees the arena too
            log.info(
                "KV layers go to the store %s",
                "through shared memory" if self.arena else "as Ray objects",
            )
        return self.arena

    def _write_shared(self, arena: MappedArena, item: _LayerOut, kv: LayerKV):
        """Copy one layer into the store's arena and tell the store; the claim of the unit's
        slots (one round trip per unit) is made with its first layer, released with its last:
        by this worker, or, when the decode worker is told directly, by the decode worker
        once it has copied the unit. A notice that cannot be delivered fails the flush (the
        router then retries the request) and leaves the release to this worker.

        When the decode worker is told directly, the store (which then only caches the blocks)
        is told of the unit's layers in one call with its last, not one call per layer;
        returns None for the layers it is not told of yet."""
        job, keys, layer = item.job, item.keys, item.layer
        claim = job.claims.get(keys[0])
        if claim is None:
            claim = job.claims[keys[0]] = ray.get(self.store.claim.remote(keys))
        slots, lease_id = claim
        arena.write(slots, layer, kv)
        self.num_shared_writes += 1
        last = layer == self.engine.model_config.num_layers - 1
        release = lease_id if last else None
        if item.offered is not None:  # its page notice first (the lender is rarely behind)
            item.offered.wait(OFFER_WAIT_S)
        if job.peer is not None:
            peer = job.peer
            notice = LayerNotice(job.key, item.unit, layer, lease_id if last else 0, tuple(slots))
            if self._notify(job, notice):
                release = None
            else:
                unreachable = f"the decode worker's notice socket {peer} is unreachable"
                job.puts.append(_failed(ConnectionError(unreachable)))
        layers = job.unreported.setdefault(item.unit, [])
        layers.append(layer)
        if job.peer is not None and not last:
            return None
        del job.unreported[item.unit]
        self.num_store_reports += 1
        return self.store.layer_written.remote(keys, layers, slots, release)

    def _notify(self, job: _Job, notice) -> bool:
        """Tell the decode worker; False (logged once per request) when it cannot be reached."""
        if job.peer is None:
            return False
        try:
            self.notices.send(job.peer, notice)
            return True
        except OSError as error:
            self.num_failed_notices += 1
            log.warning("cannot notify the decode worker of %s: %s", job.key, error)
            job.peer = None  # the rest goes through the store alone
            if job.lends:
                self._lend_done(job, decode=True)  # nobody there reads our pages any more
            return False

    def _on_answer(self, peer: KvPeer, answer: ReleaseNotice | None) -> None:
        """In the event loop: a decode worker needs none of a receive's lent pages any more,
        or (None) its connection ended and it needs none at all."""
        with self.lend_lock:
            if answer is None:
                jobs = [job for (path, _), job in self.lent.items() if path == peer.path]
            else:
                jobs = [job] if (job := self.lent.get((peer.path, answer.key))) else []
        for job in jobs:
            self._lend_done(job, decode=True)

    def _lend_done(self, job: _Job, decode: bool = False, publisher: bool = False) -> None:
        """The decode worker or the publisher is done with `job`'s lent pages; once both are,
        they go back to the engine (at its next step). Any thread."""
        with self.lend_lock:
            job.decode_done |= decode
            job.publisher_done |= publisher
            pages = []
            if job.decode_done and job.publisher_done:
                pages, job.held = job.held, []
                self.lent.pop(job.lent_key, None)
        if pages:
            self.engine.pool.unhold_later(pages)
        if publisher and not job.decode_done and self.notices.loop is not None:
            self.notices.loop.call_soon_threadsafe(
                self.notices.loop.call_later, LEND_TIMEOUT_S, self._reclaim, job
            )

    def _reclaim(self, job: _Job) -> None:
        """The decode worker never answered for `job`'s pages: take them back."""
        if job.decode_done:
            return
        self.num_reclaimed_lends += 1
        log.warning(
            "took back %d pages lent for %s: no answer %g s after the last was sent",
            len(job.held),
            job.key,
            LEND_TIMEOUT_S,
        )
        self._lend_done(job, decode=True)

    async def _flush(self, job: _Job) -> None:
        """Wait until every layer of `job` was sent and stored."""
        sent = concurrent.futures.Future()
        self.outbox.put(_FlushOut(sent))
        await asyncio.wrap_future(sent)
        await asyncio.gather(*job.puts)

    def _flush_later(self, name: str, job: _Job) -> None:
        """Finish `job`'s puts in the background (`name`: the prefill call's ticket or request
        id); a failure is logged and kept for `stored`, which the router awaits and then
        retries the request from its first token."""
        flush = asyncio.get_running_loop().create_task(self._flush(job))
        self.flushes[name] = flush

        def done(task: asyncio.Task) -> None:
            if self.flushes.get(name) is task:
                del self.flushes[name]
            if task.cancelled() or task.exception() is None:
                return
            log.error("storing the KV of %s failed: %s", name, task.exception())
            self.num_failed_flushes += 1
            self.failed_flushes[name] = str(task.exception())
            while len(self.failed_flushes) > RECENT_REQUESTS:
                self.failed_flushes.popitem(last=False)

        flush.add_done_callback(done)


def _plan_keys(job: _Job) -> list[bytes]:
    return [key for unit in job.units for key in unit.keys]


async def _failed(error: Exception) -> None:
    raise error
