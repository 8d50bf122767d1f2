"""The prefill worker: loads a cached prefix, computes the rest in chunks, and publishes
each layer of each chunk to the KV store as soon as that layer is computed.

The actor takes `PrefillTask`s and keeps each attempt as one `Job` (job.py) in one map
(jobs.py); its concerns live beside it: the prefix load (prefix_load.py), the publisher
thread (publisher.py), the lender that tells a decode worker on this node of each layer
directly and lends it this worker's pages (lender.py), and the engine's hooks that hand each
step's layers to them (hooks.py)."""

from __future__ import annotations

import dataclasses
import time

import ray

from halfmoon.cluster.worker.actor import EngineWorker
from halfmoon.cluster.worker.errors import WorkerError, aborted
from halfmoon.engine.async_engine import EngineFailure
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.outputs import RequestOutput
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.locate import local_store_name
from halfmoon.prefill_worker.hooks import Concerns, JobHooks
from halfmoon.prefill_worker.job import DirectPeer, Job, LayerOut
from halfmoon.prefill_worker.jobs import Jobs
from halfmoon.prefill_worker.lender import Lender
from halfmoon.prefill_worker.node_store import NodeStore
from halfmoon.prefill_worker.prefix_load import PrefixLoader
from halfmoon.prefill_worker.publisher import Publisher
from halfmoon.prefill_worker.remote_send import RemoteSender
from halfmoon.prefill_worker.task import PrefillResult, PrefillTask


class PrefillWorker(EngineWorker):
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
        self.jobs = Jobs()
        hooks = JobHooks(self.jobs)
        super().__init__(name, LLMEngine(config, hooks=hooks))
        self.node = ray.get_runtime_context().get_node_id()
        self.store = NodeStore(store, get_timeout_s)
        # Made now, before the step thread runs: a decode worker's first request waits on it.
        actor_name = ray.get_runtime_context().get_actor_name() or None
        lender = Lender(self.engine, actor_name, config.share_kv, self.jobs)
        remote = RemoteSender(transfer or TransferSettings())
        publisher = Publisher(self.engine, self.store, lender, remote, self._send)
        prefix = PrefixLoader(self.engine, self.store, get_timeout_s, remote.endpoint)
        self.parts = Concerns(prefix, publisher, lender, remote)
        hooks.serve(self.parts)

    def _kv_transfer(self) -> str:
        return self.parts.remote.path

    async def store_name(self) -> str:
        """Name of the store node this worker publishes to (decode pulls from it)."""
        return local_store_name()

    def _extra_counters(self) -> dict:
        parts = (self.parts.prefix, self.parts.publisher, self.parts.lender, self.parts.remote)
        own = {"num_flushing": self.jobs.num_flushing()}
        return own | {key: value for part in parts for key, value in part.counters().items()}

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
        self.parts.lender.start(job, task.lend)
        await self.parts.prefix.find(job, task.fetch_from)
        self.jobs.open(job)
        try:
            if job.aborted:  # while the prefix lookup was in flight, or before the call landed
                return aborted(task.request_id)
            firsts = await self._first_outputs(task, job.key)
            if firsts[-1].finish_reason == "abort":
                return aborted(task.request_id)
            computed_at = time.time()
        except EngineFailure as error:  # a step failed (e.g. its store node died mid-load)
            return WorkerError("UNAVAILABLE", str(error), retryable=True)  # nothing was sent
        except HalfmoonError as error:
            return WorkerError.of(error)
        finally:
            self._end(job)
        self.parts.publisher.flush_later(job)
        return job.result(task, firsts, arrived_at, computed_at)

    def _new_job(self, task: PrefillTask) -> Job:
        """The job; a decode worker on this node is told directly, one on another node with a
        transfer engine is asked where the layers go (prefill_worker/remote_send.py)."""
        units = self._plan_transfer(task.request_id, task.token_ids, task.block_keys)
        peer, remote = task.kv_peer, None
        key = task.ticket or task.request_id
        if peer is not None and peer.node_id != self.node:
            if peer.engine is not None:
                remote = self.parts.remote.start(key, peer.engine)
            peer = None
        job = Job(task.request_id, key, units, task.block_keys, DirectPeer(peer))
        job.layerwise, job.arena_loads, job.remote = task.layerwise, task.arena_loads, remote
        return job

    def _end(self, job: Job) -> None:
        """The job's call returns: its prefix lease goes, and its lent pages once read."""
        self.jobs.close(job)
        self.parts.prefix.release(job)
        if job.lend is not None:  # after the job's last layer: its pages can go once read
            self.parts.publisher.end(job)

    async def _first_outputs(self, task: PrefillTask, key: str) -> list[RequestOutput]:
        """The output of each of the request's `n` sequences, each its first token (or the
        abort's, last); the engine knows the attempt by its key."""
        params = dict(max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True)
        first, prior = dataclasses.replace(task.params, **params), task.num_prior_output_tokens
        outputs = self._engine().generate(
            task.token_ids, first, key, task.block_keys, num_prior_output_tokens=prior
        )
        return [out async for out in outputs]

    async def kv_export(self):
        """How a decode worker on this node opens this worker's KV cache to copy lent pages
        from (`engine/kv_cache.py`); None when this worker does not lend them."""
        return self.parts.lender.export

    async def warm(self, block_keys: list[bytes], store_name: str | None = None) -> int:
        """Load the stored KV of the prefix chain `block_keys` from the store node `store_name`
        (default: this node's) into this worker's own pages as cached prefix pages, so later
        requests with that prefix hit locally. Returns how many blocks were added."""
        if not self.engine.facts.prefix_caching:
            return 0
        store = ray.get_actor(store_name) if store_name else self.store.handle
        return await self.parts.prefix.warm(self._engine(), block_keys, store, store_name)

    async def stored(self, request_id: str, ticket: str | None = None) -> bool | WorkerError:
        """Wait until the KV of the prefill `ticket` (or `request_id`) returned is all in the
        store: True (at once for a call this worker does not know), or a retryable
        `WorkerError` when storing it failed. The router awaits this beside the decode
        worker's first output: a prefill worker that dies or fails to store its last layers
        ends the attempt at once, not after the decode worker's `store.get_timeout_s`."""
        why = await self.jobs.stored(ticket or request_id)
        if why is None:
            return True
        return WorkerError("UNAVAILABLE", f"storing the KV of {request_id} failed: {why}", True)

    async def publish_time(self, request_id: str) -> float | None:
        """When the last layer of the last chunk of a recent request was published."""
        return self.jobs.published_at(request_id)

    def _held_request_ids(self) -> set[str]:
        return self.jobs.keys()

    def _forget_store(self, name: str) -> None:
        if name == self.store.name:
            self.store.reset()
        self.parts.prefix.forget_store(name)

    async def abort(self, request_id: str, ticket: str | None = None) -> bool:
        """End attempt `ticket` (or `request_id`) of the request; a `prefill` call with the
        same `ticket` that lands later is refused, and an earlier attempt's abort (another
        ticket) leaves a retry here alone."""
        self.jobs.abort(request_id, ticket)
        return self._engine().abort(ticket or request_id)

    def _send(self, item: LayerOut):
        """How the publisher thread sends one layer (a seam for fault-injecting tests)."""
        return self.parts.publisher.send(item)
