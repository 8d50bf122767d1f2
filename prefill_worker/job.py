"""One prefill attempt's record, split by the concern that owns each part, and the items the
step thread hands the publisher and lender threads. Each part says which thread writes it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import torch
from ray.actor import ActorHandle

from halfmoon.engine.kv_cache import HostLayer
from halfmoon.engine.outputs import RequestOutput
from halfmoon.kvstore.layout import LayerKV
from halfmoon.kvstore.shared_arena import MappedArena
from halfmoon.kvstore.transfer.channel import KvPeer
from halfmoon.kvstore.transfer.plan import TransferUnit
from halfmoon.prefill_worker.remote_prefix import RemotePrefix, RemoteSlots
from halfmoon.prefill_worker.remote_send import RemoteSend
from halfmoon.prefill_worker.task import PrefillResult, PrefillTask


@dataclass(frozen=True, slots=True)
class ArenaSlots:
    """A stored prefix's slots in this node's shared arena, leased there (`lease_id`)."""

    arena: MappedArena
    slots: list[int]
    lease_id: int


@dataclass(slots=True)
class PrefixLoad:
    """A stored prefix on its way into our pages (step thread only): each layer copied out of
    this node's arena (`arena`), read out of another node's on the transfer engine (`remote`),
    else one future per layer (`layers`) of the store's `get_layer`."""

    first_block: int
    pages: list[int]
    arena: ArenaSlots | None = None
    remote: RemotePrefix | None = None
    layers: list[concurrent.futures.Future[LayerKV]] | None = None


@dataclass(slots=True)
class PrefixState:
    """The prefix load's part: the stored blocks after ours, the store node that holds them
    (reported as `loaded_from`: a store node's name, or "redis") and the lease on them there,
    all written on the event loop before the engine sees the job; the load in flight and what
    it loaded, written on the step thread after."""

    source: ActorHandle | None = None
    store_blocks: int = 0
    loaded_from: str | None = None
    lease_id: int | None = None
    local_slots: ArenaSlots | None = None  # this node's arena holds all of it
    remote_slots: RemoteSlots | None = None  # another node's, read on the transfer engine
    load: PrefixLoad | None = None
    num_loaded_tokens: int = 0
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Claim:
    """A unit's arena slots claimed in the store, held by `lease_id` until its last layer."""

    slots: list[int]
    lease_id: int


@dataclass(slots=True)
class Publication:
    """The publisher's part: `next_unit` and `published_at` are the step thread's; `claims`
    (by a unit's first key) and `unreported` (layers per unit the store was not told of yet)
    the publisher thread's; `puts` is appended by the publisher thread and read on the event
    loop only once a `FlushOut` queued behind them fired; `flush` and `failure` (why storing
    the KV failed) are the event loop's."""

    next_unit: int = 0
    published_at: float = 0.0
    claims: dict[bytes, Claim] = field(default_factory=dict)
    unreported: dict[int, list[int]] = field(default_factory=dict)
    puts: list[Awaitable[object]] = field(default_factory=list)
    flush: asyncio.Task | None = None
    failure: str | None = None


class DirectPeer:
    """The decode worker on this node that is told directly; read by the step, publisher and
    lender threads, dropped (under a lock, once) by whichever of the last two finds its
    socket failed."""

    __slots__ = ("_peer", "_lock")

    def __init__(self, peer: KvPeer | None) -> None:
        self._peer = peer
        self._lock = threading.Lock()

    def get(self) -> KvPeer | None:
        return self._peer

    def drop(self) -> bool:
        """Stop telling it anything; True for the call that dropped it."""
        with self._lock:
            dropped, self._peer = self._peer is not None, None
        return dropped


@dataclass(slots=True)
class Lend:
    """This job's pages lent to the decode worker at socket `path`: those held so far (the
    step thread adds, under the lender's lock) and whether the decode worker and the
    publisher are done with them (they are given back when both are)."""

    path: str
    held: list[int] = field(default_factory=list)
    decode_done: bool = False
    publisher_done: bool = False
    offering: bool = True  # the lender thread's: False once offering a layer failed


@dataclass(slots=True)
class Job:
    """One prefill attempt, named by its `key` (the ticket, else the request id: what the
    engine and the decode worker's notices call it): its transfer plan and each concern's
    part of it. `ended`: its call returned; `aborted`: its ticket was (a call of it that lands
    after is refused). Both are the event loop's."""

    request_id: str  # what error messages and the result name
    key: str
    units: list[TransferUnit]
    block_keys: list[bytes]
    peer: DirectPeer
    layerwise: bool = True
    arena_loads: bool = True
    prefix: PrefixState = field(default_factory=PrefixState)
    published: Publication = field(default_factory=Publication)
    lend: Lend | None = None  # set on the event loop before the engine sees the job
    # The decode worker on another node writes land in, on the transfer engine (remote_send.py).
    remote: RemoteSend | None = None
    ended: bool = False
    aborted: bool = False

    def result(
        self, task: PrefillTask, firsts: list[RequestOutput], arrived_at: float, computed_at: float
    ) -> PrefillResult:
        """What the call answers: each sequence's first token, and where its time went."""
        prefix = self.prefix
        loaded = prefix.num_loaded_tokens
        return PrefillResult(
            request_id=self.request_id,
            first_tokens=[
                (out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None)
                for out in sorted(firsts, key=lambda out: out.index)
            ],
            num_prompt_tokens=len(task.token_ids),
            num_local_cached_tokens=firsts[-1].num_cached_tokens - loaded,
            num_loaded_tokens=loaded,
            loaded_from=prefix.loaded_from if loaded else None,
            arrived_at=arrived_at,
            started_at=prefix.started_at or arrived_at,
            computed_at=computed_at,
            finished_at=time.time(),
            last_layer_published_at=self.published.published_at,
        )

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
    snapshot: HostLayer | None = None
    pages: list[int] | None = None
    ready: torch.cuda.Event | None = None
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
