"""A receive's life on the decode worker after its reserve: the copy-in of its KV, the join to
the batch once its first token is known, the router's hand-off (`generate`), and its end: a
hand-off that finds it in, an abort, or no hand-off in time (its router died or lost track of
it: its pages are freed).

Each receive is one `Receive` record (decode_worker/receives.py); its `phase` says who may end
it, so an abort and a hand-off, or an abort and the timer, never both free it. All of this runs
on the actor's event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from halfmoon.cluster.worker.errors import WorkerError, aborted
from halfmoon.decode_worker.notices import Notices
from halfmoon.decode_worker.receive import Receiver
from halfmoon.decode_worker.receives import Receive, Receives
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.errors import HalfmoonError
from halfmoon.kvstore.transfer.plan import TransferUnit

log = logging.getLogger(__name__)
# A receive whose KV has landed (or whose copy-in failed) and that no `generate` claims
# within this many seconds is freed: the router that made it died or lost track of it. The
# router hands over as soon as its prefill returns, a moment before its last layers land.
HANDOFF_TIMEOUT_S = 60.0


class Handoffs:
    """Copies each receive in, joins it, hands it over, and frees it exactly once."""

    def __init__(
        self,
        engine: Callable[[], AsyncEngine],
        receives: Receives,
        notices: Notices,
        receiver: Receiver,
        get_timeout_s: float,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
    ) -> None:
        self.engine = engine  # the worker's, made on first use inside the event loop
        self.receives = receives
        self.notices = notices
        self.receiver = receiver
        self.get_timeout_s = get_timeout_s
        self.handoff_timeout_s = handoff_timeout_s
        self.num_expired = 0
        self.num_early_joins = 0

    def counters(self) -> dict:
        return {
            "num_receiving": len(self.receives),
            "num_expired_reservations": self.num_expired,
            "num_early_joins": self.num_early_joins,
        }

    def start(
        self, receive: Receive, store, units: list[TransferUnit], pages: list[int], store_name
    ) -> None:
        """Copy the receive's KV into `pages` from `store` (its stream, or as notices say)."""
        copy_in = asyncio.create_task(self._copy_in(receive, store, units, pages, store_name))
        copy_in.add_done_callback(lambda done: self._await_handoff(receive, done))
        receive.copy_in = copy_in

    async def hand_over(self, key: str, first_token_id) -> WorkerError | None:
        """The router's hand-off of the receive `key`: wait for its last layer and its join;
        why it failed (or finds no receive), or None (the engine then streams the request)."""
        receive = self.receives.live(key)
        if receive is None or receive.phase != "receiving":
            return self._unclaimed(key)
        receive.phase = "handed_over"
        receive.give_first_token(first_token_id)
        failure = await _received(receive, self.get_timeout_s)
        if receive.phase == "ended":  # `abort` took it (and freed it)
            return aborted(receive.request_id)
        if failure is not None:
            self.free(receive)
            return failure
        self._end(receive)
        return None if receive.join_error is None else WorkerError.of(receive.join_error)

    def _unclaimed(self, key: str) -> WorkerError:
        """Why a hand-off finds no receive: freed unclaimed, or never made here."""
        ended = self.receives.ended(key)
        if ended is not None and ended.expired:
            return WorkerError(
                "UNAVAILABLE",
                f"the reservation of {ended.request_id} was freed: nothing claimed it "
                f"{self.handoff_timeout_s:g} s after its KV landed",
                retryable=True,
            )
        return WorkerError("NOT_FOUND", f"request {key} has no reservation here")

    def abort(self, key: str) -> bool | None:
        """End the live receive `key` and free its pages; None when there is none."""
        receive = self.receives.live(key)
        if receive is None:
            return None
        receive.copy_in.cancel()
        return self.free(receive)

    def free(self, receive: Receive) -> bool:
        """End a receive and abort its request: its pages are freed (and lent pages it copied
        from given back) only once the writes already issued have landed."""
        self.receiver.kv_cache.wait_writes()
        self._end(receive)
        return self.engine().abort(receive.key)

    def _end(self, receive: Receive) -> None:
        if self.receives.end(receive):
            self.notices.undirect(receive)

    def _await_handoff(self, receive: Receive, copy_in: asyncio.Task) -> None:
        """The copy-in failed: free its pages unless `generate` or `abort` claims it within
        `handoff_timeout_s`. A copy-in whose KV landed armed the same timer then."""
        if copy_in.cancelled() or receive.phase != "receiving":
            return  # aborted, or already handed over
        if copy_in.exception() is not None:
            asyncio.get_running_loop().call_later(self.handoff_timeout_s, self._expire, receive)

    def _expire(self, receive: Receive) -> None:
        if receive.phase != "receiving":
            return
        copy_in, failure = receive.copy_in, None
        if copy_in.done() and not copy_in.cancelled():
            failure = copy_in.exception()  # retrieved, so asyncio does not log it as lost
        copy_in.cancel()  # it may wait for a first token that no hand-off will bring
        log.warning(
            "freed the reservation of %s: no hand-off %g s after its KV %s",
            receive.request_id,
            self.handoff_timeout_s,
            "landed" if failure is None else f"failed ({failure})",
        )
        self.num_expired += 1
        receive.expired = True
        self.free(receive)

    async def _copy_in(self, receive: Receive, store, units, pages: list[int], store_name) -> None:
        """Copy the prompt's KV in, then join the batch once the first token is known (the
        join's own error is kept for `hand_over`)."""
        await self.receiver.receive(store, receive, units, pages, store_name)
        # The KV is in: from now on, a hand-off is due within handoff_timeout_s.
        asyncio.get_running_loop().call_later(self.handoff_timeout_s, self._expire, receive)
        token = receive.first_token
        if not token.done():
            await token
        if receive.phase == "receiving":
            self.num_early_joins += 1  # joining before the router's hand-off
        receive.timings.joined_at = time.time()
        try:
            await self.engine().join(receive.key, token.result())
        except HalfmoonError as error:
            receive.join_error = error


async def _received(receive: Receive, timeout_s: float) -> WorkerError | None:
    """Wait (up to `timeout_s`, `store.get_timeout_s`) for the receive's KV to be in and its
    join; why it is not, or None."""
    request_id = receive.request_id
    try:
        await asyncio.wait_for(receive.copy_in, timeout_s)
    except asyncio.CancelledError:
        return aborted(request_id)
    except TimeoutError:
        return WorkerError(
            "UNAVAILABLE",
            f"the KV of {request_id} was not all in the store {timeout_s} s after "
            "its prefill ended (store.get_timeout_s)",
            retryable=True,
        )
    except Exception as error:  # noqa: BLE001 - the router learns why, as data
        return WorkerError(
            "UNAVAILABLE", f"receiving the KV of {request_id} failed: {error}", retryable=True
        )
    return None
