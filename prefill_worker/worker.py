"""The prefill worker: loads a cached prefix, computes the rest in chunks, and publishes
each layer of each chunk to the KV store as soon as that layer is computed.

The actor takes `PrefillTask`s; its concerns live beside it: the prefix load
(prefix_load.py), the publisher thread (publisher.py) and the lender that tells a decode
worker on this node of each layer directly and lends it this worker's pages (lender.py)."""

from __future__ import annotations

import dataclasses
import time

import ray

from halfmoon.cluster.worker.actor import EngineWorker
from halfmoon.cluster.worker.errors import WorkerError, aborted
from halfmoon.engine.async_engine import EngineFailure
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.outputs import RequestOutput
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.sequence import Sequence
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.locate import local_store_name
from halfmoon.kvstore.transfer.notice_format import TokenNotice
from halfmoon.prefill_worker.job import Job, LayerOut
from halfmoon.prefill_worker.lender import Lender
from halfmoon.prefill_worker.node_store import NodeStore
from halfmoon.prefill_worker.prefix_load import PrefixLoader
from halfmoon.prefill_worker.publisher import Publisher
from halfmoon.prefill_worker.remote_send import RemoteSender
from halfmoon.prefill_worker.task import PrefillResult, PrefillTask


class PrefillWorker(EngineWorker, KVHooks):
    """Prefill-only engine; its KV goes layer by layer to the store for the decode worker."""

    kind = "prefill"

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        store=None,
        get_timeout_s: float = 30.0,
        transfer: TransferSettings | None = None,
    ):
        if config.prefill_chunk_size is None:
            raise ValueError("a prefill worker needs EngineConfig.prefill_chunk_size")
        super().__init__(name, LLMEngine(config, hooks=self))
        self.jobs: dict[str, Job] = {}  # by request id
        self.node = ray.get_runtime_context().get_node_id()
        self.store = NodeStore(store, get_timeout_s)
        # Made now, before the step thread runs: a decode worker's first request waits on it.
        actor_name = ray.get_runtime_context().get_actor_name() or None
        self.lender = Lender(self.engine, actor_name, config.share_kv)
        self.remote = RemoteSender(transfer or TransferSettings())
        self.publisher = Publisher(self.engine, self.store, self.lender, self.remote, self._send)
        self.prefix = PrefixLoader(self.engine, self.store, get_timeout_s, self.remote.endpoint)

    def _kv_transfer(self) -> str:
        return self.remote.path

    async def store_name(self) -> str:
        """Name of the store node this worker publishes to (decode pulls from it)."""
        return local_store_name()

    def _extra_counters(self) -> dict:
        own = (
            self.prefix.counters(),
            self.publisher.counters(),
            self.lender.counters(),
            self.remote.counters(),
        )
        return {key: value for counters in own for key, value in counters.items()}

    async def prefill(self, task: PrefillTask) -> PrefillResult | WorkerError:
        """Compute the prompt's KV, publish it, and return the first token (a `WorkerError`
        when it fails; the first token's outcome when the request is aborted meanwhile).

        `task.kv_peer`: the decode worker that reserved the request. When it is on this node
        and the layers go through the store's shared arena, it is told of each layer and of
        the first token straight away, and it releases each unit's claim once it has copied
        it; when this worker lends its pages (and `task.lend`), it is first told where each
        layer is in them (lender.py). `layerwise=False` and `arena_loads=False` are the
        benchmarks' baselines (prefill_worker/task.py)."""
        arrived_at = time.time()
        job = self._new_job(task)
        self.lender.start(job, task.lend)
        await self.prefix.find(job, task.fetch_from)
        self.jobs[task.request_id] = job
        try:
            if self._was_aborted(task.ticket):  # aborted while the prefix lookup was in flight
                return aborted(task.request_id)
            firsts = await self._first_outputs(task)
            if firsts[-1].finish_reason == "abort":
                return aborted(task.request_id)
            computed_at = time.time()
        except EngineFailure as error:  # a step failed (e.g. its store node died mid-load)
            return WorkerError("UNAVAILABLE", str(error), retryable=True)  # nothing was sent
        except HalfmoonError as error:
            return WorkerError.of(error)
        finally:
            self.jobs.pop(task.request_id, None)
            self.prefix.release(job)
            if job.lend is not None:  # after the job's last layer: its pages can go once read
                self.publisher.end(job)
        self.publisher.flush_later(job.key, job)
        return _result(task, job, firsts, arrived_at, computed_at)

    def _new_job(self, task: PrefillTask) -> Job:
        """The job; a decode worker on this node is told directly, one on another node with a
        transfer engine is asked where the layers go (prefill_worker/remote_send.py)."""
        units = self._plan_transfer(task.request_id, task.token_ids, task.block_keys)
        peer, remote = task.kv_peer, None
        key = task.ticket or task.request_id
        if peer is not None and peer.node_id != self.node:
            if peer.engine is not None:
                remote = self.remote.start(key, peer.engine)
            peer = None
        job = Job(units, task.block_keys, key, peer, task.layerwise, task.arena_loads)
        job.remote = remote
        return job

    async def _first_outputs(self, task: PrefillTask) -> list[RequestOutput]:
        """The output of each of the request's `n` sequences, each its first token (or the
        abort's, last)."""
        first = dataclasses.replace(
            task.params, max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True
        )
        outputs = self._engine().generate(
            task.token_ids,
            first,
            task.request_id,
            task.block_keys,
            num_prior_output_tokens=task.num_prior_output_tokens,
        )
        return [out async for out in outputs]

    async def kv_export(self):
        """How a decode worker on this node opens this worker's KV cache to copy lent pages
        from (`engine/kv_cache.py`); None when this worker does not lend them."""
        return self.lender.export

    async def warm(self, block_keys: list[bytes], store_name: str | None = None) -> int:
        """Load the stored KV of the prefix chain `block_keys` from the store node `store_name`
        (default: this node's) into this worker's own pages as cached prefix pages, so later
        requests with that prefix hit locally. Returns how many blocks were added."""
        if not self.engine.facts.prefix_caching:
            return 0
        store = ray.get_actor(store_name) if store_name else self.store.handle
        return await self.prefix.warm(self._engine(), block_keys, store, store_name)

    async def stored(self, request_id: str, ticket: str | None = None) -> bool | WorkerError:
        """Wait until the KV of the prefill `ticket` (or `request_id`) returned is all in the
        store: True (at once when it is, or for a call this worker does not know), or a
        retryable `WorkerError` when storing it failed. The router awaits this beside the
        decode worker's first output, so a prefill worker that dies (the call then fails at
        once) or fails before its last layers are stored ends the attempt right away, instead
        of the decode worker waiting `store.get_timeout_s` for layers that will never come."""
        why = await self.publisher.stored(ticket or request_id)
        if why is None:
            return True
        return WorkerError("UNAVAILABLE", f"storing the KV of {request_id} failed: {why}", True)

    async def publish_time(self, request_id: str) -> float | None:
        """When the last layer of the last chunk of a recent request was published."""
        return self.publisher.published(request_id)

    def _held_request_ids(self) -> set[str]:
        return set(self.jobs)

    def _forget_store(self, name: str) -> None:
        if name == self.store.name:
            self.store.reset()
        self.prefix.forget_store(name)

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End the request's prefill; a `prefill` call with the same `ticket` that lands later
        is refused; one of an earlier attempt that lands after a retry's prefill began here
        leaves the retry alone."""
        self._remember_abort(ticket)
        job = self.jobs.get(request_id)
        if ticket is not None and job is not None and job.key != ticket:
            return False
        return self._engine().abort(request_id)

    def _send(self, item: LayerOut):
        """How the publisher thread sends one layer (a seam for fault-injecting tests)."""
        return self.publisher.send(item)

    # KVHooks: called from the engine's step thread.

    def external_prefix_blocks(self, seq: Sequence, first_block: int, max_blocks: int) -> int:
        job = self.jobs.get(seq.request_id)
        return 0 if job is None else self.prefix.external_blocks(job, first_block, max_blocks)

    def load_prefix(self, seq: Sequence, first_block: int, pages: list[int]) -> None:
        self.prefix.start(self.jobs[seq.request_id], first_block, pages)

    def writes_before(self, batch: list[ScheduledSeq]) -> bool:
        return any(
            job.load is not None
            for item in batch
            if (job := self.jobs.get(item.seq.request_id)) is not None
        )

    def before_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            if (job := self.jobs.get(item.seq.request_id)) is not None:
                self.prefix.before_layer(job, layer)

    def after_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            if (job := self.jobs.get(item.seq.request_id)) is not None:
                self.publisher.after_layer(job, item, layer)

    def sampled(self, seq: Sequence, token_id: int) -> None:
        """The first token, to the decode worker told directly, from the step that sampled it
        (the decode worker joins once it and every layer are in, in either order): sent from
        here when that cannot wait, else by a publishing thread."""
        job = self.jobs.get(seq.request_id)
        if job is None or seq.params.n > 1:  # a notice carries one token
            return
        if job.remote is not None:  # to another node, from the sender's token thread
            self.remote.token(job.remote, job.key, token_id)
            return
        notice = TokenNotice(job.key, token_id)
        if job.peer is not None and not self.lender.try_notify_now(job, notice):
            self.publisher.token(job, token_id)


def _result(
    task: PrefillTask, job: Job, firsts: list[RequestOutput], arrived_at: float, computed_at: float
) -> PrefillResult:
    last = firsts[-1]
    return PrefillResult(
        request_id=task.request_id,
        first_tokens=[
            (out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None)
            for out in sorted(firsts, key=lambda out: out.index)
        ],
        num_prompt_tokens=len(task.token_ids),
        num_local_cached_tokens=last.num_cached_tokens - job.num_loaded_tokens,
        num_loaded_tokens=job.num_loaded_tokens,
        loaded_from=job.loaded_from if job.num_loaded_tokens else None,
        arrived_at=arrived_at,
        started_at=job.started_at or arrived_at,
        computed_at=computed_at,
        finished_at=time.time(),
        last_layer_published_at=job.last_layer_published_at,
    )
