"""Continuous batching: which sequences run this step and how many tokens each computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    """FCFS with a per-step token budget, chunked prefill and preemption by recompute."""

    def __init__(self, pool: PagePool, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work: running sequences first, then new ones while budget lasts."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new):
                preempted = True
                continue
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            cached = self.pool.attach_cached_prefix(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not self.pool.can_grow(seq, seq.num_computed_tokens + num_new):
                self.pool.release(seq)
                seq.num_computed_tokens = 0
                break
            self.pool.grow(seq, seq.num_computed_tokens + num_new)
            self.waiting.popleft()
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
                self.num_cached_prompt_tokens += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its pages (full blocks stay cached)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.pool.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the latest arrivals until `seq` can grow; False if `seq` itself was preempted."""
        while not self.pool.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.pool.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
