"""The prefill worker's KV hooks: the engine's step thread calls them; each finds its job by
the sequence's id (the attempt's key) and hands it to the concern it is for."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.sequence import Sequence
from halfmoon.kvstore.transfer.notice_format import TokenNotice
from halfmoon.prefill_worker.jobs import Jobs
from halfmoon.prefill_worker.lender import Lender
from halfmoon.prefill_worker.prefix_load import PrefixLoader
from halfmoon.prefill_worker.publisher import Publisher
from halfmoon.prefill_worker.remote_send import RemoteSender


@dataclass(slots=True)
class Concerns:
    """What a prefill worker does with a job besides computing it: each a thread or two."""

    prefix: PrefixLoader
    publisher: Publisher
    lender: Lender
    remote: RemoteSender


class JobHooks(KVHooks):
    """Routes the engine's hooks to the jobs' concerns (handed over by `serve`: they need the
    engine this is given to)."""

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.parts: Concerns | None = None

    def serve(self, parts: Concerns) -> None:
        self.parts = parts

    def external_prefix_blocks(self, seq: Sequence, first_block: int, max_blocks: int) -> int:
        job = self.jobs.get(seq.request_id)
        return 0 if job is None else self.parts.prefix.external_blocks(job, first_block, max_blocks)

    def load_prefix(self, seq: Sequence, first_block: int, pages: list[int]) -> None:
        self.parts.prefix.start(self.jobs.get(seq.request_id), first_block, pages)

    def writes_before(self, batch: list[ScheduledSeq]) -> bool:
        return any(
            job.prefix.load is not None
            for item in batch
            if (job := self.jobs.get(item.seq.request_id)) is not None
        )

    def before_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            if (job := self.jobs.get(item.seq.request_id)) is not None:
                self.parts.prefix.before_layer(job, layer)

    def after_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        for item in batch:
            if (job := self.jobs.get(item.seq.request_id)) is not None:
                self.parts.publisher.after_layer(job, item, layer)

    def sampled(self, seq: Sequence, token_id: int) -> None:
        """The first token, to the decode worker told directly, from the step that sampled it
        (the decode worker joins once it and every layer are in, in either order): sent from
        here when that cannot wait, else by a publishing thread."""
        job = self.jobs.get(seq.request_id)
        if job is None or seq.params.n > 1:  # a notice carries one token
            return
        if job.remote is not None:  # to another node, from the sender's token thread
            self.parts.remote.token(job.remote, job.key, token_id)
            return
        notice = TokenNotice(job.key, token_id)
        if job.peer.get() is not None and not self.parts.lender.try_notify_now(job, notice):
            self.parts.publisher.token(job, token_id)
