"""The prefill worker's one map of attempts: the live jobs by key, and the last few ended ones
(what `stored`, `publish_time` and a decode worker's late answers for lent pages read)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator

from halfmoon.prefill_worker.job import Job

RECENT_JOBS = 1024


class Jobs:
    """Jobs by key. Opened and closed on the event loop only; the step thread reads `live`
    (a dict's get is atomic, and a job is opened before the engine sees its key)."""

    def __init__(self) -> None:
        self.live: dict[str, Job] = {}
        self.ended: OrderedDict[str, Job] = OrderedDict()

    def open(self, job: Job) -> None:
        self.live[job.key] = job

    def get(self, key: str) -> Job | None:
        """The live job `key` (any thread)."""
        return self.live.get(key)

    def keys(self) -> set[str]:
        return set(self.live)

    def close(self, job: Job) -> None:
        """The job's call returned: kept among the recent ended ones."""
        self.live.pop(job.key, None)
        self.ended[job.key] = job
        self.ended.move_to_end(job.key)
        while len(self.ended) > RECENT_JOBS:
            self.ended.popitem(last=False)

    def find(self, key: str) -> Job | None:
        """The job `key`, live or recently ended."""
        return self.live.get(key) or self.ended.get(key)

    def lent_to(self, path: str) -> list[Job]:
        """The jobs whose pages the decode worker at socket `path` still holds."""
        return [
            job
            for job in self._all()
            if job.lend is not None and job.lend.path == path and not job.lend.decode_done
        ]

    async def stored(self, key: str) -> str | None:
        """Wait for the ended job `key`'s puts; why storing them failed, or None (also for a
        job this worker does not know)."""
        job = self.ended.get(key)
        if job is None:
            return None
        if job.published.flush is not None:
            await asyncio.wait([job.published.flush])  # its outcome is read from the job
        return job.published.failure

    def published_at(self, request_id: str) -> float | None:
        """When the last layer of the latest attempt of `request_id` was published."""
        times = [job.published.published_at for job in self._all() if job.request_id == request_id]
        return max(times) if times and max(times) else None

    def num_flushing(self) -> int:
        return sum(
            1
            for job in self.ended.values()
            if job.published.flush and not job.published.flush.done()
        )

    def _all(self) -> Iterator[Job]:
        yield from self.live.values()
        yield from self.ended.values()
