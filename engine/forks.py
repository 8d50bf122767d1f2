"""A request's `n` sequences: one until its prompt is computed, then forked into siblings that
read the prompt's pages (copied on write, `PagePool.grow`) and sample apart."""

from __future__ import annotations

import dataclasses

import torch

from halfmoon.engine.device_copy import device_tensor
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sampling_params import SEED_LIMIT, SamplingParams
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.sequence import Sequence


class Forks:
    """Forks sequences asking for `n` > 1 into their siblings, in the pool and the batch."""

    def __init__(self, pool: PagePool, scheduler: Scheduler, device: torch.device) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.device = device

    def generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sequence `index`'s random source: seeded with `seed + index` (mod 2**63), so a
        seeded request reproduces, sequence by sequence, and sequence 0 draws as with n=1."""
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed((params.seed + index) % SEED_LIMIT)

    def fork(self, seq: Sequence) -> list[Sequence]:
        """`seq`, whose prompt is computed, becomes its request's `n` sequences: the others
        are copies reading its pages (copied on write, `PagePool.grow`) and run beside it."""
        group = [seq]
        for index in range(1, seq.num_forks):
            sibling = self._sibling(seq, index)
            self.pool.fork(seq, sibling)
            group.append(sibling)
        for member in group:
            member.num_forks, member.siblings = 1, group
        self.scheduler.running.extend(group[1:])
        return group

    def _sibling(self, seq: Sequence, index: int) -> Sequence:
        """Sequence `index` of `seq`'s request: a copy of its tokens and keys so far, its own
        random source, and no pages yet (`PagePool.fork` gives it the prompt's)."""
        return dataclasses.replace(
            seq,
            token_ids=list(seq.token_ids),
            block_table=[],
            block_keys=list(seq.block_keys),
            logprobs=[],
            index=index,
            generator=self.generator(seq.params, index),
        )

    def fork_sampled(
        self, logits: torch.Tensor, sampled: list[Sequence]
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """The step's sampled sequences with each prompt just computed that asks for `n` > 1
        forked (`fork`), and a logits row for each: its request's sequences all sample from
        the prompt's last row."""
        if all(seq.num_forks == 1 for seq in sampled):
            return logits, sampled
        rows, seqs = [], []
        for row, seq in enumerate(sampled):
            group = self.fork(seq) if seq.num_forks > 1 else [seq]
            rows += [row] * len(group)
            seqs += group
        return logits[device_tensor(rows, logits.device)], seqs
