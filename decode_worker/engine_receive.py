"""The decode half of the transfer-engine path (kvstore/transfer/engine.py): the worker's
endpoint and staging region, the grants it gives prefill workers on other nodes, and the
landed notices it hears from them.

At reserve, a receive whose prefill worker is on another node waits for that worker's word
(`kv_grant`): a grant of staging slots it will write each layer into, or none (it has no
endpoint, or the staging is full), and then the layers come through the store's stream as
before. The engine's notifications are read on a thread of their own while any receive is in
flight and handed to the event loop; each is checked against the receive it names (its
grant's token, a unit and a layer of its plan) and refused and counted otherwise."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from halfmoon.decode_worker.receives import Receive, Receives
from halfmoon.engine.kv_cache import PagedKvCache
from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.transfer.engine import EngineAddress, FirstToken, open_endpoint, parse_notice
from halfmoon.kvstore.transfer.staging import Grant, StagingArea

log = logging.getLogger(__name__)
POLL_S = 0.0002  # between two reads of the engine's notifications while receives are open


class EngineReceiver:
    """Grants staging slots to remote prefill workers and takes their landed notices."""

    def __init__(self, kv_cache: PagedKvCache, receives: Receives, settings: TransferSettings):
        self.receives = receives
        self.endpoint, self.path = open_endpoint(settings)
        self.staging = None
        if self.endpoint is not None:
            self.staging = StagingArea(kv_cache.layout, settings.staging_bytes, self.endpoint)
        self.num_layers = kv_cache.num_layers
        self.block_size = kv_cache.layout.block_size
        self.loop: asyncio.AbstractEventLoop | None = None
        self.advertised = False  # prefill workers were told how to reach the endpoint
        self.open = 0  # receives waiting for landed or first-token notices
        self.wake = threading.Event()
        self.num_landed = 0
        self.num_refused = 0  # notices naming no grant of ours, a wrong token or place
        if self.endpoint is not None:
            threading.Thread(target=self._poll_forever, name="kv-engine", daemon=True).start()

    def counters(self) -> dict:
        own = {
            "kv_transfer_path": self.path,
            "num_landed_notices": self.num_landed,
            "num_refused_landed_notices": self.num_refused,
        }
        if self.staging is not None:
            own |= self.staging.counters() | self.endpoint.counters()
        return own

    def address(self, actor_name: str | None) -> EngineAddress | None:
        """How prefill workers elsewhere reach this worker (None: they use the store)."""
        if self.endpoint is None or not actor_name:
            return None
        self.advertised = True
        return EngineAddress(self.endpoint.session, actor_name)

    def expect(self, receive: Receive) -> None:
        """At reserve: a receive from another node, whose prefill worker was given this
        worker's address, waits for that worker's word."""
        if self.advertised:
            receive.engine = asyncio.get_running_loop().create_future()

    async def grant(self, key: str, accept: bool, wait_s: float) -> Grant | None:
        """A prefill worker's word on the receive `key` (it can write: `accept`): the slots it
        writes into, or None (through the store). Waits `wait_s` for the reserve it may have
        overtaken."""
        receive = await self._receive(key, wait_s)
        if receive is None or receive.engine is None or receive.engine.done():
            return None
        num_blocks = -(-receive.num_tokens // self.block_size)
        grant = self.staging.grant(num_blocks) if accept else None
        receive.engine.set_result(grant)
        return grant

    async def _receive(self, key: str, wait_s: float) -> Receive | None:
        deadline = time.monotonic() + wait_s
        while (receive := self.receives.live(key)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # the reserve, sent with the prefill, is a moment away
        return receive

    def opened(self) -> None:
        """A receive now waits for landed notices: read them until it ends (`closed`)."""
        self.loop = asyncio.get_running_loop()
        self.open += 1
        self.wake.set()

    def closed(self, receive: Receive, grant: Grant, clean: bool) -> None:
        """The receive ended: its slots go back; the notices are read on until its first
        token is known too (its notice may come after the last layer's)."""
        self.staging.release(grant, clean)
        token = receive.first_token
        if clean and not token.done():
            token.add_done_callback(lambda _: self._unwatch())
        else:
            self._unwatch()

    def _unwatch(self) -> None:
        self.open -= 1
        if not self.open:
            self.wake.clear()

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()

    def _poll_forever(self) -> None:
        while True:
            self.wake.wait()
            notes = self.endpoint.notifies()
            if notes:
                self.loop.call_soon_threadsafe(self._on_notes, notes)
            else:
                time.sleep(POLL_S)

    def _on_notes(self, notes: list[tuple[str, str]]) -> None:
        for name, message in notes:
            notice = parse_notice(name, message)
            receive = self.receives.live(name) if notice is not None else None
            grant = None
            if receive is not None and receive.engine is not None:
                engine = receive.engine
                grant = engine.result() if engine.done() and not engine.cancelled() else None
            if grant is None or notice.token != grant.token or not self._fits(notice):
                if receive is not None or notice is None:  # else: a receive that ended
                    self.num_refused += 1
                    log.warning("refused a transfer notice %r for %r", message[:64], name[:64])
                continue
            if isinstance(notice, FirstToken):
                receive.give_first_token(notice.token_id)
                continue
            self.num_landed += 1
            receive.landed.add((notice.unit, notice.layer))
            receive.arrived.set()

    def _fits(self, notice) -> bool:
        return isinstance(notice, FirstToken) or notice.layer < self.num_layers
