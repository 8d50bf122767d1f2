"""The publisher: hands each layer of each transfer unit to the store (its shared arena on
this node, else `put_layer`) from its own thread, so the step loop never waits on the store,
and tracks each prefill's puts until they are all stored."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

import ray

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.shared_arena import MappedArena
from halfmoon.kvstore.transfer.notice_format import LayerNotice, TokenNotice
from halfmoon.prefill_worker.job import Claim, EndOut, FlushOut, Job, LayerOut, TokenOut
from halfmoon.prefill_worker.lender import Lender
from halfmoon.prefill_worker.node_store import NodeStore
from halfmoon.prefill_worker.remote_send import RemoteSender

log = logging.getLogger(__name__)
# How long the publisher waits for the lender thread to offer a layer's pages before it sends
# the layer's slots notice anyway (the decode worker then takes whichever came first).
OFFER_WAIT_S = 1.0


class Publisher:
    """Publishes computed layers; `send` is how one layer goes (the actor's, so a test can
    subclass the actor to inject faults)."""

    def __init__(
        self,
        engine: LLMEngine,
        store: NodeStore,
        lender: Lender,
        remote: RemoteSender,
        send: Callable[[LayerOut], object] | None = None,
    ) -> None:
        self.engine = engine
        self.kv_cache = engine.kv_cache
        self.store = store
        self.lender = lender
        self.remote = remote
        self.send_layer = send or self.send
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.num_failed_flushes = 0
        self.num_shared_writes = 0
        self.num_store_reports = 0  # `layer_written` calls: one per unit with direct notices
        threading.Thread(target=self._send_forever, name="kv-publisher", daemon=True).start()

    def counters(self) -> dict:
        return {
            "num_shared_writes": self.num_shared_writes,
            "num_store_reports": self.num_store_reports,
            "num_failed_flushes": self.num_failed_flushes,
        }

    def after_layer(self, job: Job, item: ScheduledSeq, layer: int) -> None:
        """Step thread: layer `layer` of `item`'s chunk is computed; publish what it completes
        (every unit's every layer at the end, without `layerwise`)."""
        num_layers = self.engine.facts.num_layers
        last_layer = layer == num_layers - 1
        seq = item.seq
        end = seq.num_computed_tokens + item.num_new_tokens
        published = job.published
        # Taken before the layer is queued: the publisher and lender threads may send it, and
        # the decode worker receive it, before this thread runs again.
        queued_at = time.time()
        if job.layerwise:
            ready = [u for u in job.units[published.next_unit :] if u.end_token <= end]
            for index in range(published.next_unit, published.next_unit + len(ready)):
                self._publish(job, seq.block_table, index, layer)
        elif last_layer and end == len(seq):
            ready = job.units
            for each_layer in range(num_layers):
                for index in range(len(ready)):
                    self._publish(job, seq.block_table, index, each_layer)
        else:
            return
        if last_layer and ready:
            published.next_unit += len(ready)
            if published.next_unit == len(job.units):
                published.published_at = queued_at

    def _publish(self, job: Job, block_table: list[int], index: int, layer: int) -> None:
        unit = job.units[index]
        pages = block_table[unit.first_block : unit.first_block + len(unit.keys)]
        if job.lend is not None:  # held from the unit's first layer; read by the publisher
            self.outbox.put(self.lender.offer(job, index, layer, pages))
            return
        # Snapshot the pages here (a small copy); the publisher thread does the slow send.
        snapshot = self.kv_cache.read_layer(layer, pages)
        self.outbox.put(LayerOut(job, index, layer, snapshot))

    def token(self, job: Job, token_id: int) -> None:
        """Tell the decode worker the first token after the layers queued before it."""
        item = TokenOut(job, token_id)
        if job.lend is not None:
            self.lender.queue_token(item)
        else:
            self.outbox.put(item)

    def end(self, job: Job) -> None:
        """The job's prefill call ended: its lent pages can go once read."""
        self.outbox.put(EndOut(job))

    def _send_forever(self) -> None:
        """Publisher thread: hands snapshots to the store so the step loop never waits on it.
        One `put_layer` call per snapshot: batching the backlog into one call was measured
        slower (its serialization holds the GIL longer against the step thread)."""
        while True:
            item = self.outbox.get()
            if isinstance(item, FlushOut):
                item.done.set_result(None)  # everything queued before it is sent
            elif isinstance(item, TokenOut):
                self.lender.notify(item.job, TokenNotice(item.job.key, item.token_id))
            elif isinstance(item, EndOut):
                self.lender.done(item.job, publisher=True)
            else:
                self._send_one(item)

    def _send_one(self, item: LayerOut) -> None:
        try:
            put = self.send_layer(item)
            if put is not None:
                item.job.published.puts.append(put)
        except Exception as error:  # noqa: BLE001 - the thread must live; the flush fails
            log.exception("publishing a KV snapshot of %d blocks failed", len(item.keys))
            item.job.published.puts.append(_failed(error))

    def send(self, item: LayerOut):
        """Send one layer of some blocks to the store; returns the store call's ObjectRef
        (None: the store is told later, see `_write_shared`). For a decode worker on another
        node it is first written into the staging slots it granted (the store's copy then
        only feeds the cache). A lent layer is read from the (held) pages here, off the step
        thread."""
        if item.pages is None:
            kv = item.snapshot.wait()
        else:
            kv = self.kv_cache.read_layer(item.layer, item.pages, after=item.ready).wait()
        job = item.job
        if job.remote is not None:
            first_block = job.units[item.unit].first_block
            self.remote.send(job.remote, job.key, item.unit, first_block, item.layer, kv)
        arena = self.store.arena()
        if arena is None:
            return self.store.handle.put_layer.remote(item.keys, item.layer, kv)
        return self._write_shared(arena, item, kv)

    def _write_shared(self, arena: MappedArena, item: LayerOut, kv: LayerKV):
        """Copy one layer into the store's arena and tell the store; the claim of the unit's
        slots (one round trip per unit) is made with its first layer, released with its last:
        by this worker, or, when the decode worker is told directly, by the decode worker
        once it has copied the unit. A notice that cannot be delivered fails the flush (the
        router then retries the request) and leaves the release to this worker.

        When the decode worker is told directly, the store (which then only caches the blocks)
        is told of the unit's layers in one call with its last, not one call per layer;
        returns None for the layers it is not told of yet."""
        job, keys, layer = item.job, item.keys, item.layer
        store = self.store.handle
        slots, lease_id = self._claim(job, keys)
        arena.write(slots, layer, kv)
        self.num_shared_writes += 1
        last = layer == self.engine.facts.num_layers - 1
        release = lease_id if last else None
        if item.offered is not None:  # its page notice first (the lender is rarely behind)
            item.offered.wait(OFFER_WAIT_S)
        peer = job.peer.get()  # read once: the lender drops it when the socket fails
        if peer is not None:
            notice = LayerNotice(job.key, item.unit, layer, lease_id if last else 0, tuple(slots))
            if self.lender.notify(job, notice):
                release = None
            else:
                unreachable = f"the decode worker's notice socket {peer} is unreachable"
                job.published.puts.append(_failed(ConnectionError(unreachable)))
        layers = job.published.unreported.setdefault(item.unit, [])
        layers.append(layer)
        if (job.peer.get() is not None or job.remote_granted()) and not last:
            return None  # nobody streams the unit out of the store before it is whole
        del job.published.unreported[item.unit]
        self.num_store_reports += 1
        return store.layer_written.remote(keys, layers, slots, release)

    def _claim(self, job: Job, keys: list[bytes]) -> tuple[list[int], int]:
        """The unit's arena slots and their lease, claimed in the store with its first layer
        (the one store call this thread waits for: the slots are needed to write into)."""
        claim = job.published.claims.get(keys[0])
        if claim is None:
            claimed = self.store.handle.claim.remote(keys)
            slots, lease_id = ray.get(claimed, timeout=self.store.timeout_s)
            claim = job.published.claims[keys[0]] = Claim(slots, lease_id)
        return claim.slots, claim.lease_id

    async def _flush(self, job: Job) -> None:
        """Wait until every layer of `job` was sent and stored."""
        sent = concurrent.futures.Future()
        self.outbox.put(FlushOut(sent))
        await asyncio.wrap_future(sent)
        await asyncio.wait_for(asyncio.gather(*job.published.puts), self.store.timeout_s)

    def flush_later(self, job: Job) -> None:
        """Finish `job`'s puts in the background; a failure is logged and kept on the job for
        `stored`, which the router awaits and then retries the request from its first token."""
        flush = asyncio.get_running_loop().create_task(self._flush(job))
        flush.add_done_callback(functools.partial(self._flushed, job))
        job.published.flush = flush

    def _flushed(self, job: Job, flush: asyncio.Task) -> None:
        job.published.puts.clear()  # the store's answers are not needed any more
        if flush.cancelled() or flush.exception() is None:
            return
        log.error("storing the KV of %s failed: %s", job.request_id, flush.exception())
        self.num_failed_flushes += 1
        job.published.failure = str(flush.exception())


async def _failed(error: Exception) -> None:
    raise error
