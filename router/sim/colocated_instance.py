"""A simulated colocated instance, as vLLM runs one: prefill and decode share one continuous
batch. Each step every decoding sequence advances a token and prefill chunks fill the rest of
the token budget (chunked prefill, oldest prompt first); the step is priced by the same
`CostModel.step_time` as every other simulated engine, so a prefill chunk lengthens the decode
step it rides in. Prompts start from the instance's own prefix cache (`SimPrefill`'s LRU).

Decode-only stretches run in closed form (`SimDecode`), so the cost is one event per step
that carries prefill and one per join or finish, not one per token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from halfmoon.router.prefix_index import PrefixIndex
from halfmoon.router.profile import Profile
from halfmoon.router.sim.decode_instance import Finished, SimDecode
from halfmoon.router.sim.prefill_instance import SimPrefill
from halfmoon.router.sim.step_engine import next_chunk


@dataclass(slots=True)
class ColocatedJob:
    """A prompt routed here: prefilled in chunks, then decoded in the same batch."""

    request_id: str
    keys: Sequence[int]
    num_prompt_tokens: int
    num_output_tokens: int
    predicted_s: float
    computed: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class FirstToken:
    """A prompt whose prefill ended at `time_s` (its first token)."""

    request_id: str
    time_s: float
    cached_tokens: int


class SimColocated:
    """One colocated instance: its waiting and prefilling prompts, decode batch and cache."""

    def __init__(
        self,
        name: str,
        profile: Profile,
        cache_blocks: int,
        index: PrefixIndex,
        block_size: int,
        max_batched_tokens: int,
    ) -> None:
        self.name = name
        self.cost = profile.cost
        self.block_size = block_size
        self.max_batched_tokens = max_batched_tokens
        self.capacity_tokens = profile.decode_kv_capacity_tokens
        self.batch = SimDecode(name, profile.cost)
        self.cache = SimPrefill(name, cache_blocks, index)
        self.waiting: deque[ColocatedJob] = deque()
        self.prefilling: list[ColocatedJob] = []
        self.reserved_tokens = 0
        self._reserved: dict[str, int] = {}
        # Predicted prefill seconds not yet computed: what a load-aware router reads.
        self.queued_prefill_s = 0.0
        self.first_tokens: list[FirstToken] = []
        self.finished: list[Finished] = []
        self.hit_blocks = 0
        self.total_blocks = 0

    @property
    def num_requests(self) -> int:
        """Requests here that have not finished: waiting, prefilling or decoding."""
        return len(self.waiting) + len(self.prefilling) + self.batch.batch_size

    def add(self, job: ColocatedJob) -> None:
        """Queue a prompt routed here at the instance's current time."""
        self.waiting.append(job)
        self.queued_prefill_s += job.predicted_s

    def advance(self, now: float) -> None:
        """Run every step that starts before `now`."""
        batch = self.batch
        while batch.clock_s < now:
            if self._prefill_step():
                continue
            if batch.batch_size == 0:
                batch.clock_s = now
                return
            self._finish(batch.advance(now, until_finish=bool(self.waiting)))

    def drain(self) -> None:
        """Run until every routed request has finished."""
        batch = self.batch
        while self.waiting or self.prefilling or batch.batch_size:
            if not self._prefill_step():
                self._finish(batch.advance(batch.next_finish_s(), until_finish=True))

    def _prefill_step(self) -> bool:
        """Run one step carrying prefill chunks beside the decode batch; False if none can."""
        batch = self.batch
        budget = self.max_batched_tokens - batch.batch_size
        chunks: list[tuple[int, int]] = []
        jobs: list[ColocatedJob] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(job, budget, chunks, jobs)
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            job = self.waiting.popleft()
            self.prefilling.append(job)
            budget -= self._chunk(job, budget, chunks, jobs)
        if not chunks:
            return False
        seconds = self.cost.step_time(chunks, batch.batch_size, batch.kv_tokens)
        self._finish(batch.step(seconds))
        for (size, _), job in zip(chunks, jobs, strict=True):
            share = job.predicted_s * size / max(job.num_prompt_tokens - job.cached_tokens, 1)
            self.queued_prefill_s = max(self.queued_prefill_s - share, 0.0)
            job.computed += size
            if job.computed >= job.num_prompt_tokens:
                self._prefilled(job)
        return True

    def _chunk(self, job: ColocatedJob, budget: int, chunks: list, jobs: list) -> int:
        size = next_chunk(job.num_prompt_tokens, job.computed, budget, self.cost.chunk_tokens)
        chunks.append((size, job.computed))
        jobs.append(job)
        return size

    def _admit(self, job: ColocatedJob) -> bool:
        """Start `job` if its KV fits: reserve it and take its cached prefix."""
        reserve = job.num_prompt_tokens + job.num_output_tokens
        if self.reserved_tokens + reserve > self.capacity_tokens:
            return False
        self.reserved_tokens += reserve
        self._reserved[job.request_id] = reserve
        depth = self.cache.prefix_depth(job.keys)
        job.cached_tokens = job.computed = max(
            min(depth * self.block_size, job.num_prompt_tokens - 1), 0
        )
        self.hit_blocks += depth
        self.total_blocks += len(job.keys)
        return True

    def _prefilled(self, job: ColocatedJob) -> None:
        self.prefilling.remove(job)
        self.cache.store(job.keys)
        now = self.batch.clock_s
        self.first_tokens.append(FirstToken(job.request_id, now, job.cached_tokens))
        if job.num_output_tokens > 1:
            self.batch.join(job.request_id, job.num_prompt_tokens + 1, job.num_output_tokens - 1)
        else:
            self.reserved_tokens -= self._reserved.pop(job.request_id)

    def _finish(self, done: list[Finished]) -> None:
        if done:
            self.finished.extend(done)
            for item in done:
                self.reserved_tokens -= self._reserved.pop(item.request_id)
