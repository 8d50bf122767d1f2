"""The lender: tells a decode worker on this node of a job's layers and first token directly
(kvstore/transfer/channel.py), and, with `EngineConfig.share_kv`, lends it this worker's own pages
(the device tier): where each layer is in them, before the store has a copy. The pages are
held until the decode worker answers that it has copied them and the publisher is done."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.kvstore.transfer.channel import KvPeer, NoticeSender
from halfmoon.kvstore.transfer.notice_format import (
    LayerNotice,
    PagesNotice,
    ReleaseNotice,
    TokenNotice,
)
from halfmoon.prefill_worker.job import Job, LayerOut, Lend, TokenOut
from halfmoon.prefill_worker.jobs import Jobs

log = logging.getLogger(__name__)
# Pages lent to a decode worker that has not answered this long after they were all sent go
# back with a warning (it answers within milliseconds; its connection ending frees them too).
LEND_TIMEOUT_S = 300.0
Notice = LayerNotice | PagesNotice | TokenNotice


class Lender:
    """Notices to decode workers on this node, and this worker's pages lent to them."""

    def __init__(
        self, engine: LLMEngine, actor_name: str | None, share_kv: bool, jobs: Jobs
    ) -> None:
        self.engine = engine
        self.kv_cache = engine.kv_cache
        # Lend pages only where a decode worker can open them: a named actor (it looks us up),
        # a cache allocated to be shared. Made now, before the step thread runs.
        self.export = self.kv_cache.export() if share_kv and actor_name else None
        self.jobs = jobs  # where a decode worker's answer finds the job it names
        self.lock = threading.Lock()  # over each job's `Lend`
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        # Used by the publisher and lender threads; the answers are read in the event loop.
        self.notices = NoticeSender(actor_name if self.export else None, self._on_answer)
        self.num_page_notices = 0
        self.num_reclaimed_lends = 0
        self.num_failed_notices = 0
        if self.export is not None:
            threading.Thread(target=self._lend_forever, name="kv-lender", daemon=True).start()

    def counters(self) -> dict:
        return {
            "num_direct_notices": self.notices.num_sent,
            "num_page_notices": self.num_page_notices,
            "num_lent_pages": self.engine.num_held_pages,
            "num_reclaimed_lends": self.num_reclaimed_lends,
            "num_failed_notices": self.num_failed_notices,
        }

    def start(self, job: Job, lend: bool) -> None:
        """Lend `job`'s pages to its decode worker when it is on this node and both can."""
        peer = job.peer.get()
        if peer is None or self.export is None or not lend:
            return
        job.lend = Lend(peer.path)
        self.notices.loop = asyncio.get_running_loop()

    def offer(self, job: Job, unit: int, layer: int, pages: list[int]) -> LayerOut:
        """Step thread: hold a unit's pages from its first layer and queue the layer's page
        notice; the same item goes to the publisher, which reads the pages itself."""
        if layer == 0:
            self.engine.hold_pages(pages)
            with self.lock:
                job.lend.held.extend(pages)
        ready = self.kv_cache.mark()
        item = LayerOut(job, unit, layer, pages=pages, ready=ready, offered=threading.Event())
        self.queue.put(item)
        return item

    def queue_token(self, item: TokenOut) -> None:
        """Publisher: the first token goes to the decode worker after the layers queued."""
        self.queue.put(item)

    def try_notify_now(self, job: Job, notice: TokenNotice) -> bool:
        """Step thread: send `notice` now if that never blocks; False to queue it instead."""
        peer = job.peer.get()  # read once: another thread drops it when the socket fails
        return peer is not None and self.notices.try_send(peer, notice)

    def notify(self, job: Job, notice: Notice) -> bool:
        """Tell the decode worker; False (logged once per request) when it cannot be reached."""
        peer = job.peer.get()  # read once: another thread drops it when the socket fails
        if peer is None:
            return False
        try:
            self.notices.send(peer, notice)
            return True
        except OSError as error:
            self.num_failed_notices += 1
            log.warning("cannot notify the decode worker of %s: %s", job.request_id, error)
            # The rest goes through the store alone.
            if job.peer.drop() and job.lend is not None:
                self.done(job, decode=True)  # nobody there reads our pages any more
            return False

    def _lend_forever(self) -> None:
        """Lender thread: tells the decode worker of each lent layer as soon as it is in our
        pages (on CUDA, once its compute has run), and then of the first token."""
        while True:
            item = self.queue.get()
            job = item.job
            try:
                if isinstance(item, TokenOut):
                    self.notify(job, TokenNotice(job.key, item.token_id))
                    continue
                if item.ready is not None:
                    item.ready.synchronize()  # the layer is in the pages before anyone reads them
                live = job.peer.get() is not None and job.lend.offering
                if live and not job.lend.decode_done:
                    notice = PagesNotice(job.key, item.unit, item.layer, tuple(item.pages))
                    if self.notify(job, notice):
                        self.num_page_notices += 1
            except Exception:  # noqa: BLE001 - the thread must live; the arena's copy stays
                log.exception("offering lent pages of %s failed", job.request_id)
                # Nothing more is offered (the decode worker takes the arena's copies); what
                # was offered stays held until it answers.
                job.lend.offering = False
            finally:
                if isinstance(item, LayerOut):
                    item.offered.set()

    def _on_answer(self, peer: KvPeer, answer: ReleaseNotice | None) -> None:
        """In the event loop: a decode worker needs none of a receive's lent pages any more,
        or (None) its connection ended and it needs none at all."""
        if answer is None:
            jobs = self.jobs.lent_to(peer.path)
        else:
            job = self.jobs.find(answer.key)
            jobs = [job] if job and job.lend and job.lend.path == peer.path else []
        for job in jobs:
            self.done(job, decode=True)

    def done(self, job: Job, decode: bool = False, publisher: bool = False) -> None:
        """The decode worker or the publisher is done with `job`'s lent pages; once both are,
        they go back to the engine (at its next step). Any thread."""
        lend = job.lend
        with self.lock:
            lend.decode_done |= decode
            lend.publisher_done |= publisher
            pages = []
            if lend.decode_done and lend.publisher_done:
                pages, lend.held = lend.held, []
        if pages:
            self.engine.unhold_pages_later(pages)
        if publisher and not lend.decode_done and self.notices.loop is not None:
            self.notices.loop.call_soon_threadsafe(
                self.notices.loop.call_later, LEND_TIMEOUT_S, self._reclaim, job
            )

    def _reclaim(self, job: Job) -> None:
        """The decode worker never answered for `job`'s pages: take them back."""
        if job.lend.decode_done:
            return
        self.num_reclaimed_lends += 1
        log.warning(
            "took back %d pages lent for %s: no answer %g s after the last was sent",
            len(job.lend.held),
            job.request_id,
            LEND_TIMEOUT_S,
        )
        self.done(job, decode=True)
