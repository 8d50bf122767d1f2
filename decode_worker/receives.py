"""One record per KV receive on the decode worker (`Receive`: an attempt, from its reserve to its
end) and the worker's one registry of them (`Receives`), keyed by what names the attempt
everywhere: its ticket (its request id when the reserve came without one).

The registry keeps the live receives, the notices that came before their reserve, and the
recently ended receives: a late notice for one is given back at once, a late `generate` learns
why it finds none, and its timings stay readable. Everything here runs on the actor's event
loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterator

from halfmoon.engine.errors import HalfmoonError
from halfmoon.kvstore.transfer.channel import NoticeConn
from halfmoon.kvstore.transfer.notice_format import LayerNotice, Notice, PagesNotice

# Ended receives remembered, so their late notices are released at once and a late
# `generate` or `receive_timings` still finds them.
RECENT_ENDS = 4096


@dataclasses.dataclass(slots=True)
class ReceiveTimings:
    """When a request's KV arrived (wall-clock seconds since epoch)."""

    reserved_at: float
    first_layer_received_at: float = 0.0
    all_received_at: float = 0.0
    first_token_at: float = 0.0  # the first token became known here
    joined_at: float = 0.0
    num_bytes: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class Receive:
    """One attempt's KV on its way into pages reserved for it, then joining the batch.

    `phase`: "receiving" (reserved, the router has not handed it over), "handed_over"
    (`generate` waits for the last layer), "ended". `first_token`: from the reserve of a
    retry, the prefill worker's notice or `generate`, whichever comes first (a list, one per
    sequence, when `n` > 1: no notice carries those). `copy_in`: the task copying the KV in
    and joining the batch. `expired`: it ended freed unclaimed (no hand-off in time).

    When the prefill worker tells this worker directly (`direct`), its notices fill
    `layers` (arena slots this worker owes the store a release of) and `pages` (its own pages
    lent, with the connection owed a `ReleaseNotice`: `lenders`; `refused`: connections whose
    later page notices are refused too, as the lender may have taken them back). From another
    node (decode_worker/engine_receive.py), `engine` is its word (a staging `Grant`, or None:
    the store's stream) and `landed` the (unit, layer)s written. `arrived` wakes the copy-in
    on any of these."""

    request_id: str
    key: str
    first_token: asyncio.Future
    num_tokens: int
    direct: bool = False
    phase: str = "receiving"
    # On CUDA, an event after the last readers of the reserved pages (`PagedKvCache.mark`):
    # writes into them wait for it, not for every step queued since.
    fence: object | None = None
    copy_in: asyncio.Task | None = None
    expired: bool = False
    join_error: HalfmoonError | None = None
    timings: ReceiveTimings = dataclasses.field(
        default_factory=lambda: ReceiveTimings(reserved_at=time.time())
    )
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

    def give_first_token(self, token_id: int | list[int]) -> None:
        """The first token is known (the first to say it wins; later ones are the same)."""
        if not self.first_token.done():
            self.first_token.set_result(token_id)


class Receives:
    """The decode worker's receives by key: live, ended recently, and notices waiting for one."""

    def __init__(self) -> None:
        self._live: dict[str, Receive] = {}
        self._ended: OrderedDict[str, Receive] = OrderedDict()
        self._early: dict[str, list[tuple[Notice, NoticeConn]]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Receive]:
        return iter(list(self._live.values()))

    def open(
        self, request_id: str, key: str, num_tokens: int, direct: bool, first_token_id=None
    ) -> Receive:
        """A new live receive `key` (the caller replays `take_early(key)` into it)."""
        first_token = asyncio.get_running_loop().create_future()
        receive = Receive(request_id, key, first_token, num_tokens, direct)
        if first_token_id is not None:
            receive.give_first_token(first_token_id)
        receive.first_token.add_done_callback(
            lambda token: (
                token.cancelled() or setattr(receive.timings, "first_token_at", time.time())
            )
        )
        self._live[key] = receive
        return receive

    def live(self, key: str) -> Receive | None:
        return self._live.get(key)

    def ended(self, key: str) -> Receive | None:
        """The receive `key` if it ended recently (the last RECENT_ENDS are kept)."""
        return self._ended.get(key)

    def find(self, name: str) -> Receive | None:
        """The receive `name`, live or ended recently; else the latest of request id `name`."""
        found = self._live.get(name) or self._ended.get(name)
        if found is None:
            everyone = (*reversed(self._live.values()), *reversed(self._ended.values()))
            found = next((r for r in everyone if r.request_id == name), None)
        return found

    def end(self, receive: Receive) -> bool:
        """`receive` ends (once: False when it had already); its first token will not come now."""
        if receive.phase == "ended":
            return False
        receive.phase = "ended"
        receive.copy_in = None
        if self._live.get(receive.key) is receive:
            del self._live[receive.key]
        self._ended[receive.key] = receive
        while len(self._ended) > RECENT_ENDS:
            self._ended.popitem(last=False)
        receive.first_token.cancel()  # no-op once known
        return True

    def hold_early(self, key: str, notice: Notice, conn: NoticeConn) -> bool:
        """Keep a notice that overtook its reserve; True for the first one of `key`."""
        first = key not in self._early
        self._early.setdefault(key, []).append((notice, conn))
        return first

    def take_early(self, key: str) -> list[tuple[Notice, NoticeConn]]:
        """The notices that came for `key` before its reserve (none are kept after)."""
        return self._early.pop(key, [])
