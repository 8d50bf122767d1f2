"""The router side's only way to call a worker or a store node: small typed clients over their
Ray handles (a call returns the ObjectRef or stream Ray gives, for the caller to await)."""

from __future__ import annotations

import ray

from halfmoon.cluster.worker.info import WorkerInfo, WorkerLoad, WorkerReport
from halfmoon.cluster.worker.task import RequestTask
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.prefill_worker.task import PrefillTask


class WorkerClient:
    """What the router asks of any worker, prefill or decode."""

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    async def info(self) -> WorkerInfo:
        return await self.handle.info.remote()

    async def load(self) -> WorkerLoad:
        return await self.handle.load.remote()

    async def report(self) -> WorkerReport:
        """Load, steps, block events and KV receives since the last report, in one call."""
        return await self.handle.report.remote()

    async def serve_metrics(self, host: str) -> str:
        return await self.handle.serve_metrics.remote(host)

    async def snapshot(self) -> list:
        """Every block its own pages hold (BlockEvents), for a router starting afresh."""
        return await self.handle.snapshot.remote()

    def abort(self, request_id: str, ticket: str | None):
        """End attempt `ticket` of `request_id` there: its pages, leases and streams."""
        return self.handle.abort.remote(request_id, ticket)


class PrefillClient(WorkerClient):
    """A prefill worker: prefill a prompt, wait for its KV stored, warm a prefix."""

    def prefill(self, task: PrefillTask):
        """Prefill the task's prompt, publishing its KV; returns its PrefillResult."""
        return self.handle.prefill.remote(task)

    def stored(self, request_id: str, ticket: str):
        """Ends when every layer of the attempt is in the store (or the attempt ended)."""
        return self.handle.stored.remote(request_id, ticket)

    def warm(self, keys: list[bytes], store_name: str):
        """Load the stored prefix chain `keys` from store `store_name` into its own pages."""
        return self.handle.warm.remote(keys, store_name)


class DecodeClient(WorkerClient):
    """A decode worker: reserve pages for a request's KV, then stream its tokens."""

    def reserve(self, task: DecodeTask):
        """Reserve pages for the task's KV and start receiving it."""
        return self.handle.reserve.remote(task)

    def generate(self, ticket: str, first_token_id: int | list[int]):
        """The stream of the reserved attempt `ticket`, from its first token on."""
        generate = self.handle.generate.options(num_returns="streaming")
        return generate.remote(ticket, first_token_id)

    def generate_colocated(self, task: RequestTask):
        """The stream of a request this worker prefills and decodes itself."""
        return self.handle.generate_colocated.options(num_returns="streaming").remote(task)


class StoreClient:
    """What the router asks of a store node: its block events and its tiers' stats."""

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    async def report(self) -> tuple[list, object]:
        """(block events since the last report, StoreStats)."""
        return await self.handle.drain_events.remote(), await self.handle.stats.remote()

    async def stats(self):
        return await self.handle.stats.remote()

    async def snapshot(self) -> list:
        """Every block its tiers hold (BlockEvents), for a router starting afresh."""
        return await self.handle.snapshot.remote()

    async def serve_metrics(self, host: str) -> str:
        return await self.handle.serve_metrics.remote(host)


def worker_client(kind: str, handle: ray.actor.ActorHandle) -> PrefillClient | DecodeClient:
    """The client for a worker of pool `kind`."""
    return PrefillClient(handle) if kind == "prefill" else DecodeClient(handle)
