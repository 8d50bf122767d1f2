"""The prefill worker's one map of attempts by key: the live jobs and the last few ended ones
(what `stored`, `publish_time`, a decode worker's late answers for lent pages and a `prefill`
that lands after its abort read), in the order they opened or ended."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from halfmoon.prefill_worker.job import DirectPeer, Job

# Ended jobs kept (the oldest go first; live ones are never dropped).
RECENT_JOBS = 1024


class Jobs:
    """Jobs by key, live and ended (`Job.ended`). Changed on the event loop only; the step
    thread reads live ones with `get` (a dict's get is atomic, and a job is opened before the
    engine sees its key)."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, Job] = OrderedDict()
        self._num_ended = 0

    def open(self, job: Job) -> None:
        """A new live job, `aborted` if an abort of its key came first."""
        earlier = self._pop(job.key)
        job.aborted = earlier is not None and earlier.aborted
        self._records[job.key] = job

    def get(self, key: str) -> Job | None:
        """The live job `key` (any thread)."""
        job = self._records.get(key)
        return None if job is None or job.ended else job

    def keys(self) -> set[str]:
        return {key for key, job in self._records.items() if not job.ended}

    def close(self, job: Job) -> None:
        """The job's call returned: kept among the recent ended ones."""
        self._pop(job.key)
        job.ended = True
        self._keep_ended(job)

    def abort(self, request_id: str, ticket: str | None) -> None:
        """Attempt `ticket` is aborted, so a `prefill` of it that lands later is refused: an
        unknown one is kept as an ended job (without a ticket, nothing is kept)."""
        if ticket is None:
            return
        job = self._records.get(ticket)
        if job is None:
            job = Job(request_id, ticket, [], [], DirectPeer(None), ended=True)
            self._keep_ended(job)
        job.aborted = True

    def find(self, key: str) -> Job | None:
        """The job `key`, live or recently ended."""
        return self._records.get(key)

    def lent_to(self, path: str) -> list[Job]:
        """The jobs whose pages the decode worker at socket `path` still holds."""
        return [
            job
            for job in self._records.values()
            if job.lend is not None and job.lend.path == path and not job.lend.decode_done
        ]

    async def stored(self, key: str) -> str | None:
        """Wait for the ended job `key`'s puts; why storing them failed, or None (also for a
        job this worker does not know)."""
        job = self._records.get(key)
        if job is None or not job.ended:
            return None
        if job.published.flush is not None:
            await asyncio.wait([job.published.flush])  # its outcome is read from the job
        return job.published.failure

    def published_at(self, request_id: str) -> float | None:
        """When the last layer of the latest attempt of `request_id` was published."""
        jobs = self._records.values()
        times = [job.published.published_at for job in jobs if job.request_id == request_id]
        return max(times) if times and max(times) else None

    def num_flushing(self) -> int:
        """Ended jobs whose puts are still in flight (a live job flushes none yet)."""
        return sum(
            1
            for job in self._records.values()
            if job.published.flush and not job.published.flush.done()
        )

    def _pop(self, key: str) -> Job | None:
        job = self._records.pop(key, None)
        if job is not None and job.ended:
            self._num_ended -= 1
        return job

    def _keep_ended(self, job: Job) -> None:
        """The ended `job`, not kept yet, last; the oldest ended ones beyond RECENT_JOBS go."""
        self._records[job.key] = job
        self._num_ended += 1
        while self._num_ended > RECENT_JOBS:
            self._pop(next(key for key, kept in self._records.items() if kept.ended))
