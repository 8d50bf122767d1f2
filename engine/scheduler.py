"""Continuous batching: which sequences run this step and how many tokens each computes."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.engine.errors import InvalidRequestError, OutOfPagesError
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from halfmoon.engine.config import EngineSettings


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    """FCFS with a per-step token budget, chunked prefill and preemption by recompute."""

    def __init__(
        self, pool: PagePool, config: EngineSettings, hooks: KVHooks | None = None
    ) -> None:
        self.pool = pool
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.chunk_size = config.prefill_chunk_size
        self.hooks = hooks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Joined (their KV written from outside) past max_num_seqs, the largest decode graph.
        self.joined: deque[list[Sequence]] = deque()
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def resume(self, seqs: list[Sequence]) -> None:
        """Sequences parked while their grammar compiled go on: new ones to the queue, joined
        ones (their prompt's KV in) to the batch."""
        for seq in seqs:
            if seq.status is SequenceStatus.WAITING:
                self.add(seq)
            else:
                self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.joined)

    def num_tokens_to_compute(self) -> int:
        """Prompt tokens of the waiting and running sequences not computed yet."""
        seqs = itertools.chain(self.waiting, self.running)
        return sum(len(seq) - seq.num_computed_tokens for seq in seqs)

    def num_kv_tokens(self) -> int:
        """Tokens in the running sequences' KV."""
        return sum(seq.num_computed_tokens for seq in self.running)

    def reserve(self, seq: Sequence) -> None:
        """Hold pages for all of `seq`'s tokens, whose KV is written from outside (disaggregated
        decode), until it joins; `OutOfPagesError` when they are not free."""
        if not self.pool.can_grow(seq, len(seq)):
            raise OutOfPagesError(self.pool.pages_needed(seq, len(seq)), self.pool.num_free_pages)
        self.pool.grow(seq, len(seq))
        seq.status = SequenceStatus.RESERVED

    def join(self, seq: Sequence, first_token_ids: list[int]) -> None:
        """The reserved `seq`, its prompt's KV all in its pages, runs from its first tokens
        (one for each sequence it becomes)."""
        if len(first_token_ids) != seq.num_forks:
            raise InvalidRequestError(
                "first_token_ids", first_token_ids, f"must be one per sequence: n = {seq.num_forks}"
            )
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.pool.cache_full_blocks(seq)
        self.running.append(seq)

    def hold(self, group: list[Sequence], parked: bool) -> None:
        """A joined request's sequences, just added to the batch, leave it while their grammar
        compiles (`parked`) or, past `max_num_seqs`, wait in `joined` for room."""
        full = len(self.running) > self.max_num_seqs
        if parked or full:
            for seq in group:
                self.running.remove(seq)
        if full and not parked:
            self.joined.append(group)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work: running sequences first, then new ones while budget lasts."""
        self._admit_joined()
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = self._chunk(seq, budget)
            if not self._make_room(seq, seq.num_computed_tokens + num_new):
                preempted = True
                continue
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) + seq.num_forks > self.max_num_seqs:  # room for all n
                break
            self.pool.attach_cached_prefix(seq)
            first_external = len(seq.block_table)
            num_external = self._external_prefix_blocks(seq)
            seq.num_computed_tokens += num_external * self.pool.block_size
            num_new = self._chunk(seq, budget)
            if not self.pool.can_grow(seq, seq.num_computed_tokens + num_new):
                self.pool.release(seq)
                seq.num_computed_tokens = 0
                break
            self.pool.grow(seq, seq.num_computed_tokens + num_new)
            self.waiting.popleft()
            if num_external:
                pages = seq.block_table[first_external : first_external + num_external]
                self.hooks.load_prefix(seq, first_external, pages)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self.num_cached_prompt_tokens += seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return batch

    def _admit_joined(self) -> None:
        """Joined sequences held while the batch was full go on, in order, as it has room."""
        while self.joined:
            live = [s for s in self.joined[0] if not s.finished]  # aborted meanwhile: dropped
            if self.running and len(self.running) + len(live) > self.max_num_seqs:
                return
            self.running.extend(live)
            self.joined.popleft()

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step; with `chunk_size`, chunks end on its multiples."""
        num_new = min(len(seq) - seq.num_computed_tokens, budget)
        if self.chunk_size:
            num_new = min(num_new, self.chunk_size - seq.num_computed_tokens % self.chunk_size)
        return num_new

    def _external_prefix_blocks(self, seq: Sequence) -> int:
        first = len(seq.block_table)
        most = (len(seq) - 1) // self.pool.block_size - first
        if self.hooks is None or most <= 0:
            return 0
        return min(most, self.hooks.external_prefix_blocks(seq, first, most))

    def computed(self, batch: list[ScheduledSeq]) -> None:
        """The step of `batch` ran: its new tokens are computed, and its full blocks cached."""
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.pool.cache_full_blocks(item.seq)

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
        if not self.pool.pages_needed(seq, num_tokens):  # most decode steps: the page has room
            return True
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
