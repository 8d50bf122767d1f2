"""One record per KV receive on the decode worker (`Receive`: an attempt, from its first notice
or its reserve to its end) and the worker's one registry of them (`Receives`), keyed by what
names the attempt everywhere: its ticket (its request id when the reserve came without one).

The registry's one map holds the live receives, the early ones (notices that came before their
reserve) and the recently ended ones: a late notice for one is given back at once, a late
`generate` learns why it finds none, a reserve that lands after its abort is refused, and its
timings stay readable. Everything here runs on the actor's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterator

from halfmoon.engine.errors import HalfmoonError
from halfmoon.kvstore.transfer.channel import NoticeConn
from halfmoon.kvstore.transfer.notice_format import LayerNotice, Notice, PagesNotice

# Ended receives remembered, so their late notices are released at once, a late `generate` or
# `receive_timings` still finds them and a reserve that lands after its abort is refused.
RECENT_ENDS = 4096


@dataclasses.dataclass(slots=True)
class ReceiveTimings:
    """When a request's KV arrived (wall-clock seconds since epoch; 0: not yet)."""

    reserved_at: float = 0.0
    first_layer_received_at: float = 0.0
    all_received_at: float = 0.0
    first_token_at: float = 0.0  # the first token became known here
    joined_at: float = 0.0
    num_bytes: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class Receive:
    """One attempt's KV on its way into pages reserved for it, then joining the batch.

    `phase`: "early" (notices came before its reserve: they wait in `early`), "receiving"
    (reserved, the router has not handed it over), "handed_over" (`generate` waits for the last
    layer), "ended". `first_token`: from the reserve of a retry, the prefill worker's notice or
    `generate`, whichever comes first (a list, one per sequence, when `n` > 1: no notice
    carries those). `copy_in`: the task copying the KV in and joining the batch. `expired`: it
    ended freed unclaimed (no hand-off in time). `aborted`: its ticket was aborted (a reserve of
    it that lands after is refused).

    When the prefill worker tells this worker directly (`direct`), its notices fill
    `layers` (arena slots this worker owes the store a release of) and `pages` (its own pages
    lent, with the connection owed a `ReleaseNotice`: `lenders`; `refused`: connections whose
    later page notices are refused too, as the lender may have taken them back). From another
    node (decode_worker/engine_receive.py), `engine` is its word (a staging `Grant`, or None:
    the store's stream) and `landed` the (unit, layer)s written. `arrived` wakes the copy-in
    on any of these."""

    key: str
    first_token: asyncio.Future
    request_id: str = ""  # from its reserve (or its abort) on
    num_tokens: int = 0
    direct: bool = False
    phase: str = "early"
    early: list[tuple[Notice, NoticeConn]] = dataclasses.field(default_factory=list)
    aborted: bool = False
    # On CUDA, an event after the last readers of the reserved pages (`PagedKvCache.mark`):
    # writes into them wait for it, not for every step queued since.
    fence: object | None = None
    copy_in: asyncio.Task | None = None
    expired: bool = False
    join_error: HalfmoonError | None = None
    timings: ReceiveTimings = dataclasses.field(default_factory=ReceiveTimings)
    layers: dict[tuple[int, int], LayerNotice] = dataclasses.field(default_factory=dict)
    pages: dict[tuple[int, int], tuple[PagesNotice, NoticeConn]] = dataclasses.field(
        default_factory=dict
    )
    copied: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # out of lent pages
    lenders: set[NoticeConn] = dataclasses.field(default_factory=set)
    refused: set[NoticeConn] = dataclasses.field(default_factory=set)
    lender_lost: bool = False
    arrived: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    engine: asyncio.Future | None = None
    landed: set[tuple[int, int]] = dataclasses.field(default_factory=set)

    @property
    def live(self) -> bool:
        """Reserved and not ended."""
        return self.phase in ("receiving", "handed_over")

    def give_first_token(self, token_id: int | list[int]) -> None:
        """The first token is known (the first to say it wins; later ones are the same)."""
        if not self.first_token.done():
            self.first_token.set_result(token_id)


class Receives:
    """The decode worker's receives by key, live, early and ended, in the order they were
    reserved (or first noticed) or ended; the oldest ended go beyond RECENT_ENDS."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, Receive] = OrderedDict()
        self._num_ended = 0

    def __len__(self) -> int:
        return sum(1 for receive in self._records.values() if receive.live)

    def __iter__(self) -> Iterator[Receive]:
        return iter([receive for receive in self._records.values() if receive.live])

    def open(
        self, request_id: str, key: str, num_tokens: int, direct: bool, first_token_id=None
    ) -> Receive:
        """The live receive `key`: its early record when notices came first (the caller
        replays its `early` notices into it), else a new one."""
        receive = self._records.get(key)
        if receive is None or receive.phase != "early":
            receive = self._new(key)
        self._records.move_to_end(key)
        receive.request_id, receive.num_tokens, receive.direct = request_id, num_tokens, direct
        receive.phase, receive.timings.reserved_at = "receiving", time.time()
        if first_token_id is not None:
            receive.give_first_token(first_token_id)
        return receive

    def live(self, key: str) -> Receive | None:
        receive = self._records.get(key)
        return receive if receive is not None and receive.live else None

    def ended(self, key: str) -> Receive | None:
        """The receive `key` if it ended recently (the last RECENT_ENDS are kept)."""
        receive = self._records.get(key)
        return receive if receive is not None and receive.phase == "ended" else None

    def find(self, name: str) -> Receive | None:
        """The reserved receive `name`, live or ended recently; else the latest of request id
        `name` (a live one before any that ended)."""
        found = self._records.get(name)
        if found is not None and found.timings.reserved_at:
            return found
        newest = [
            receive
            for receive in reversed(self._records.values())
            if receive.request_id == name and receive.timings.reserved_at
        ]
        return next((receive for receive in newest if receive.live), next(iter(newest), None))

    def end(self, receive: Receive) -> bool:
        """`receive` ends (once: False when it had already); its first token will not come now."""
        if receive.phase == "ended":
            return False
        receive.phase = "ended"
        receive.copy_in = None
        if self._records.get(receive.key) is receive:
            self._records.move_to_end(receive.key)
            self._num_ended += 1
            self._evict()
        receive.first_token.cancel()  # no-op once known
        return True

    def abort(self, request_id: str, ticket: str | None) -> list[tuple[Notice, NoticeConn]]:
        """Attempt `ticket` is aborted, so a reserve or colocated call of it that lands later
        is refused: one not reserved yet (unknown, or only noticed) ends now, and the notices
        that came for it are returned, to be given back. Without a ticket, nothing is kept."""
        if ticket is None:
            return []
        receive = self._records.get(ticket) or self._new(ticket)
        receive.aborted = True
        if receive.phase != "early":
            return []
        receive.request_id = request_id
        early, receive.early = receive.early, []
        self.end(receive)
        return early

    def refused(self, ticket: str | None) -> bool:
        """A call of attempt `ticket` lands after its abort."""
        receive = None if ticket is None else self._records.get(ticket)
        return receive is not None and receive.aborted

    def hold_early(self, key: str, notice: Notice, conn: NoticeConn) -> bool:
        """Keep a notice that overtook its reserve; True for the first one of `key`."""
        receive = self._records.get(key)
        first = receive is None
        if first:
            receive = self._new(key)
        receive.early.append((notice, conn))
        return first

    def drop_early(self, key: str) -> list[tuple[Notice, NoticeConn]]:
        """The notices of `key` whose reserve never came (its early record goes); none when it
        came, or its abort took them."""
        receive = self._records.get(key)
        if receive is None or receive.phase != "early":
            return []
        del self._records[key]
        return receive.early

    def _new(self, key: str) -> Receive:
        """An early record of `key`, last (an ended one of that key goes)."""
        first_token = asyncio.get_running_loop().create_future()
        receive = Receive(key, first_token)
        first_token.add_done_callback(
            lambda token: (
                token.cancelled() or setattr(receive.timings, "first_token_at", time.time())
            )
        )
        if (earlier := self._records.pop(key, None)) is not None and earlier.phase == "ended":
            self._num_ended -= 1
        self._records[key] = receive
        return receive

    def _evict(self) -> None:
        """The oldest ended receives beyond RECENT_ENDS go (live and early ones stay)."""
        while self._num_ended > RECENT_ENDS:
            oldest = next(key for key, kept in self._records.items() if kept.phase == "ended")
            del self._records[oldest]
            self._num_ended -= 1
