"""The router's picture of each instance, fed by worker reports (live) or simulated instances."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class PrefillJob:
    """A request sent to a prefill instance: its predicted seconds of work (as if it ran
    alone), how much of it is left, and its uncached prompt tokens."""

    work_s: float
    num_tokens: int
    left_s: float = -1.0  # -1: all of it
    sent_s: float = 0.0
    due_s: float = 0.0  # predicted seconds from `sent_s` to its prefill's end (0: none)

    def __post_init__(self) -> None:
        if self.left_s < 0.0:
            self.left_s = self.work_s


@dataclass(slots=True)
class PrefillView:
    """A prefill instance's outstanding work: every request sent there until it reports its
    prefill finished, each with its predicted work left, advanced as time passes.

    How the work is shared is the engine's: an engine that prefills in chunks (`shared`)
    runs one chunk of every prompt it holds in each step, so a prompt's wait is the work of
    the others up to its own length (processor sharing); an engine that does not finishes
    the first prompt first (`shared=False`: first come, first served). A finish, a drop or
    the worker's own report corrects the prediction; a misprediction never carries over."""

    instance: str
    node: str | None = None  # the store node whose host tier is local to it (None: none)
    shared: bool = False
    tensor_parallel_size: int = 1  # devices it splits the model across
    jobs: list[PrefillJob] = field(default_factory=list)  # in the order they were sent
    num_queued: int = 0  # requests sent here whose prefill has not finished
    queued_tokens: int = 0  # their uncached prompt tokens
    updated_s: float = 0.0  # when `jobs` were last advanced

    def wait_s(self, now: float) -> float:
        """Predicted seconds of work the instance has left now."""
        self.advance(now)
        return sum(job.left_s for job in self.jobs)

    def delay_s(self, now: float, work_s: float) -> float:
        """Predicted seconds a request of `work_s` sent now waits beyond its own work."""
        self.advance(now)
        if not self.shared:
            return sum(job.left_s for job in self.jobs)
        return sum(min(job.left_s, work_s) for job in self.jobs)

    def enqueue(
        self, work_s: float, num_tokens: int, now: float = 0.0, due_s: float = 0.0
    ) -> PrefillJob:
        """Count a request the router just sent here, predicted to finish its prefill `due_s`
        from `now`; returns its job."""
        self.advance(now)
        job = PrefillJob(work_s, num_tokens, sent_s=now, due_s=due_s)
        self.jobs.append(job)
        self.num_queued += 1
        self.queued_tokens += num_tokens
        return job

    def overdue(self, now: float) -> Iterator[tuple[float, float]]:
        """(predicted, waited) seconds of each request here still prefilling past its predicted
        end: how far its prediction fell short, at least (it has not finished yet)."""
        for job in self.jobs:
            waited_s = now - job.sent_s
            if 0.0 < job.due_s < waited_s:
                yield job.due_s, waited_s

    def ends_with(self, now: float, work_s: float) -> Iterator[tuple[float, float]]:
        """(waited, predicted seconds left) of each request here, were a prompt of `work_s`
        to join now; shared steps: a job's left is the others' work up to its own, plus its
        own (each job waits min(left, its left) of every other)."""
        self.advance(now)
        lefts = sorted(job.left_s for job in self.jobs)
        below = list(itertools.accumulate(lefts, initial=0.0))  # below[i]: sum of lefts[:i]
        for job in self.jobs:
            place = bisect.bisect_right(lefts, job.left_s)
            shared_s = below[place] + job.left_s * (len(lefts) - place)
            yield now - job.sent_s, shared_s + min(work_s, job.left_s)

    def finish(self, job: PrefillJob, now: float) -> None:
        """`job`'s prefill finished at `now`. First come, first served, the jobs sent after it
        have not started: all their work is left, however late it finished."""
        self.advance(now)
        if job not in self.jobs:
            return
        place = self.jobs.index(job)
        self.drop(job, now)
        if not self.shared:
            for later in self.jobs[place:]:
                later.left_s = later.work_s

    def drop(self, job: PrefillJob, now: float) -> None:
        """`job` left unfinished (cancelled, or retried elsewhere) at `now`."""
        self.advance(now)
        if job in self.jobs:
            self.jobs.remove(job)
            self.num_queued -= 1
            self.queued_tokens -= job.num_tokens

    def reconcile(self, num_requests: int, left_s: float, as_of: float) -> None:
        """The worker's own count of the requests it holds and the seconds of prompt it has
        still to compute, as of `as_of` (the end of its last step): taken as the truth when it
        holds every request sent here (none on its way), shared among them in proportion to
        what was predicted, less the work done since."""
        if num_requests != self.num_queued or not self.jobs:
            return
        self.advance(as_of)
        predicted = sum(job.left_s for job in self.jobs)
        for job in self.jobs:
            job.left_s = left_s * job.left_s / predicted if predicted > 0 else left_s / num_requests
        self._work_off(self.updated_s - as_of)

    def advance(self, now: float) -> None:
        """Take the work done since the last update off the jobs, as the engine shares it."""
        elapsed, self.updated_s = now - self.updated_s, max(now, self.updated_s)
        self._work_off(elapsed)

    def _work_off(self, elapsed: float) -> None:
        if elapsed <= 0.0 or not self.jobs:
            return
        if self.shared:
            _share(self.jobs, elapsed)
        else:
            _first_come(self.jobs, elapsed)


def _first_come(jobs: list[PrefillJob], elapsed: float) -> None:
    """`elapsed` seconds of work, the first job first."""
    for job in jobs:
        done = min(job.left_s, elapsed)
        job.left_s -= done
        elapsed -= done
        if elapsed <= 0.0:
            return


def _share(jobs: list[PrefillJob], elapsed: float) -> None:
    """`elapsed` seconds of work shared equally among the jobs with work left."""
    active = [job for job in jobs if job.left_s > 0.0]
    while active and elapsed > 0.0:
        least = min(job.left_s for job in active)
        each = min(least, elapsed / len(active))
        if each <= 0.0:  # what is left of `elapsed` is below the floats' resolution
            return
        for job in active:
            job.left_s -= each
        elapsed -= each * len(active)
        active = [job for job in active if job.left_s > 1e-12]


@dataclass(slots=True, eq=False)
class Admitted:
    """A request the router placed on a decode instance: its KV, join time and expected length
    (kept in the Conductor's book with the request; the view holds the same object)."""

    num_tokens: int
    join_s: float
    output_tokens: int
    joined: bool = False


@dataclass(slots=True)
class DecodeView:
    """A decode instance's running batch, KV tokens, free KV capacity and admitted requests."""

    instance: str
    capacity_tokens: int
    tensor_parallel_size: int = 1  # devices it splits the model across
    batch_size: int = 0
    kv_tokens: int = 0
    reserved_tokens: int = 0
    bypass_until_s: float = 0.0
    num_pending: int = 0
    pending_tokens: int = 0
    admitted: set[Admitted] = field(default_factory=set)

    @property
    def free_kv_tokens(self) -> int:
        """KV capacity (in tokens of pages) not yet reserved by a placed request."""
        return self.capacity_tokens - self.reserved_tokens

    def admit(self, entry: Admitted, reserve_tokens: int) -> None:
        """Reserve pages for a request whose prefill is about to start elsewhere."""
        self.admitted.add(entry)
        self.reserved_tokens += reserve_tokens
        self.num_pending += 1
        self.pending_tokens += entry.num_tokens

    def join(self, entry: Admitted, now: float) -> None:
        """The request's KV landed and it joined the running batch at `now`."""
        if entry not in self.admitted or entry.joined:
            return
        entry.joined = True
        entry.join_s = now
        self.num_pending -= 1
        self.pending_tokens -= entry.num_tokens

    def leave(self, entry: Admitted, reserve_tokens: int) -> None:
        """The request finished or was cancelled; give back its pages."""
        if entry not in self.admitted:
            return
        self.admitted.discard(entry)
        self.reserved_tokens -= reserve_tokens
        if not entry.joined:
            self.num_pending -= 1
            self.pending_tokens -= entry.num_tokens

    def report(self, batch_size: int, kv_tokens: int) -> None:
        """The worker's own count of its running batch and the KV it holds."""
        self.batch_size = batch_size
        self.kv_tokens = kv_tokens

    def load_at(self, when_s: float, now: float, step_s: float) -> tuple[int, int]:
        """Predicted (batch size, KV tokens) at `when_s`: requests joined by then and not yet
        finished, each staying its expected output length at `step_s` per token."""
        batch = kv = 0
        for entry in self.admitted:
            if entry.join_s > when_s:
                continue
            leave_s = entry.join_s + entry.output_tokens * step_s
            # A running request already past its expected length is still running.
            if leave_s > when_s or (entry.joined and leave_s <= now):
                batch += 1
                kv += entry.num_tokens
        return batch, kv
