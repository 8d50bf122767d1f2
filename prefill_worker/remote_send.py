"""The prefill half of the transfer-engine path (kvstore/transfer/engine.py): each layer of each
unit written straight into the staging slots a decode worker on another node granted, as the
publisher thread takes it, with the landed notice on its last write.

The grant is asked for when the prefill call arrives (`start`, one Ray call in the event loop,
answered while the prompt queues or computes its first chunk) and read by the publisher thread
with the job's first layer. The first token goes from a thread of its own the moment it is
sampled, not behind the layers still queued for the publisher (the decode worker joins once it
and every layer are in, in either order), so the decode worker need not wait for the router's
hand-off. A decode worker that grants nothing (its staging is full) gets the
layers through the store as before; so does one whose engine this worker cannot reach, by the
same word (`accept=False`). A write the engine reports as failed raises: the job's flush fails
and the router retries the request."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass

import ray

from halfmoon.kvstore.config import TransferSettings
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.transfer.engine import (
    EngineAddress,
    first_token_message,
    landed_message,
    open_endpoint,
)
from halfmoon.kvstore.transfer.staging import Grant

log = logging.getLogger(__name__)
GRANT_WAIT_S = 60.0  # the decode worker answers at once, or once the reserve it waits for came


@dataclass(slots=True)
class RemoteSend:
    """A job's receive on another node: the decode worker's answer (`asked`, resolved by Ray,
    read by the publisher and token threads), once read."""

    asked: concurrent.futures.Future[Grant | None]
    grant: Grant | None = None
    answered: bool = False


class RemoteSender:
    """Writes layers to decode workers on other nodes through this worker's endpoint."""

    def __init__(self, settings: TransferSettings) -> None:
        self.endpoint, self.path = open_endpoint(settings)
        self.decode_workers: dict[str, object] = {}  # actor handles by name, looked up once
        self.num_token_notices = 0
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        if self.endpoint is not None:
            threading.Thread(
                target=self._tell_forever, name="kv-engine-tokens", daemon=True
            ).start()

    def counters(self) -> dict:
        own = {"kv_transfer_path": self.path, "num_engine_token_notices": self.num_token_notices}
        return own | self.endpoint.counters() if self.endpoint is not None else own

    def start(self, key: str, address: EngineAddress) -> RemoteSend:
        """Event loop: ask the decode worker at `address` where the receive `key` goes."""
        actor = self.decode_workers.get(address.actor)
        if actor is None:
            actor = self.decode_workers[address.actor] = ray.get_actor(address.actor)
        return RemoteSend(actor.kv_grant.remote(key, self.endpoint is not None).future())

    def _grant(self, remote: RemoteSend) -> Grant | None:
        """The decode worker's answer (the publisher and token threads may both ask first:
        each reads the same future's value)."""
        if not remote.answered:
            remote.grant = remote.asked.result(timeout=GRANT_WAIT_S)
            remote.answered = True
        return remote.grant

    def token(self, remote: RemoteSend, key: str, token_id: int) -> None:
        """Step thread: tell the decode worker the first token, from the token thread."""
        self.tokens.put((remote, key, token_id))

    def _tell_forever(self) -> None:
        while True:
            remote, key, token_id = self.tokens.get()
            try:
                if (grant := self._grant(remote)) is not None:
                    message = first_token_message(grant.token, token_id)
                    self.endpoint.notify(grant.session, grant.base, key, message)
                    self.num_token_notices += 1
            except Exception:  # noqa: BLE001 - the thread must live; the hand-off carries it
                log.exception("telling the decode worker the first token of %s failed", key)

    def send(self, remote: RemoteSend, key: str, unit: int, first_block: int, layer: int, kv):
        """Publisher thread: write one layer of a unit's blocks into the grant; False when the
        decode worker granted nothing (the store carries it)."""
        grant = self._grant(remote)
        if grant is None:
            return False
        kv = LayerKV(kv.k.contiguous(), kv.v.contiguous())
        count = kv.num_blocks
        if not grant.holds(first_block, count):
            raise ValueError(f"the grant of {key} has no blocks {first_block}+{count}")
        k_at, v_at = grant.places(layer, first_block)
        length = count * grant.page_bytes
        if kv.k.nbytes != length:
            raise ValueError(f"layer {layer} of {key} is {kv.k.nbytes} bytes, not {length}")
        self.endpoint.write(
            grant.session,
            [(kv.k.data_ptr(), k_at, length), (kv.v.data_ptr(), v_at, length)],
            notify=(key, landed_message(grant.token, unit, layer)),
        )
        return True
