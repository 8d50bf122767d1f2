"""One prefill call's state, split by the concern that owns each part, and the items the step
thread hands the publisher and lender threads."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.kvstore.transfer.plan import TransferUnit
from halfmoon.prefill_worker.remote_prefix import RemotePrefix, RemoteSlots
from halfmoon.prefill_worker.remote_send import RemoteSend


@dataclass(slots=True)
class PrefixLoad:
    """A stored prefix on its way into our pages: each layer copied out of the store's
    shared arena (`slots`, held by `lease_id`) when the store is on this node and holds all
    of it; read out of another node's arena on the transfer engine (`remote`); else one
    ObjectRef per layer (`layers`) of the store's `get_layer`."""

    first_block: int
    pages: list[int]
    layers: list | None = None
    slots: list[int] | None = None
    lease_id: int = 0
    remote: RemotePrefix | None = None  # read from another node's arena on the engine


@dataclass(slots=True)
class Lend:
    """This job's pages lent to the decode worker: those held so far, and whether the decode
    worker and the publisher are done with them (they are given back when both are)."""

    key: tuple[str, str]  # (the decode worker's socket, the receive key)
    held: list[int] = field(default_factory=list)
    decode_done: bool = False
    publisher_done: bool = False
    offering: bool = True


@dataclass(slots=True)
class Job:
    """One prefill call: its transfer plan and what the prefix load, the publisher and the
    lender each keep of it."""

    units: list[TransferUnit]
    block_keys: list[bytes]
    key: str  # what the decode worker's notices name the receive by: ticket or request id
    peer: KvPeer | None = None  # the decode worker to notify directly, when on this node
    layerwise: bool = True
    arena_loads: bool = True
    started_at: float = 0.0
    # The prefix load's: stored blocks after ours, the store node actor that holds them (and
    # what to report it as: a store node's name, or "redis"), the lease on them there, the
    # load in flight.
    store_blocks: int = 0
    source: object = None
    loaded_from: str | None = None
    lease_id: int | None = None
    load: PrefixLoad | None = None
    num_loaded_tokens: int = 0
    # Another node's store read on the transfer engine: the prefix's slots leased there (the
    # lease is also `lease_id`, released with the others).
    remote_slots: RemoteSlots | None = None
    # The publisher's: units published so far, store calls in flight, arena claims per unit
    # (by its first key), layers per unit (by its index) the store has not been told of yet.
    next_unit: int = 0
    puts: list = field(default_factory=list)
    claims: dict = field(default_factory=dict)
    unreported: dict = field(default_factory=dict)
    last_layer_published_at: float = 0.0
    lend: Lend | None = None
    # The decode worker on another node writes land in, on the transfer engine (remote_send.py).
    remote: RemoteSend | None = None

    def remote_granted(self) -> bool:
        """Publisher thread: the layers go to another node's staging slots (read once the
        first layer was sent there)."""
        return self.remote is not None and self.remote.grant is not None


@dataclass(slots=True)
class LayerOut:
    """For the publisher: one layer of one transfer unit, snapshotted off the pages, or, when
    the job lends its pages, read from them by the publisher (`pages`, held; `ready`: on CUDA
    the event after which the layer is in them)."""

    job: Job
    unit: int  # its index in the job's plan
    layer: int
    snapshot: object = None  # HostLayer: `wait()` gives the LayerKV
    pages: list[int] | None = None
    ready: object = None
    # Set by the lender thread once the page notice is sent (or will not be): the slots
    # notice goes after it, so the decode worker sees the pages first.
    offered: threading.Event | None = None

    @property
    def keys(self) -> list[bytes]:
        return self.job.units[self.unit].keys


@dataclass(slots=True)
class TokenOut:
    """For the publisher: tell the decode worker the first token (after the layers before)."""

    job: Job
    token_id: int


@dataclass(slots=True)
class EndOut:
    """For the publisher: the job's prefill call ended; nothing more of it follows."""

    job: Job


@dataclass(slots=True)
class FlushOut:
    """For the publisher: `done` is set once everything queued before it was sent."""

    done: concurrent.futures.Future
