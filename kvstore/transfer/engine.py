"""KV between nodes on Mooncake's Transfer Engine: one endpoint per worker process.

A decode worker registers a staging region of host memory with its endpoint
(kvstore/transfer/staging.py) and grants each receive from another node a run of its slots; the
prefill worker writes each layer of each transfer unit straight into them as it is computed
(`write`: TCP, or RDMA where NICs exist) and names the layer that landed in the engine's
notification of its last write. No Ray object carries the KV, and no store is in the way.

Metadata is exchanged peer to peer (Mooncake's `P2PHANDSHAKE`: no etcd, no extra service); a
peer is named by its session, `host:port` of its handshake listener, with the host the worker's
Ray node address. Measured on the development machine (loopback, two processes): a 64 MiB
write at 2.1-2.4 GB/s once connected (the first write to a peer also sets up its connection),
~50 us per small write, and a write outside the peer's registered memory refused by the peer
("not within any registered buffer").

Mooncake 0.3.13's listeners (the handshake port and the TCP transport's) bind every interface
whatever host the engine is given (`ss -ltn` shows 0.0.0.0 and *), so by default halfmoon
starts an endpoint only where KV must cross machines (`store.transfer.engine`,
kvstore/config.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from dataclasses import dataclass

import numpy as np
import ray

from halfmoon.kvstore.config import TransferSettings

log = logging.getLogger(__name__)
# A notice: the grant's token, then the unit and the layer that landed ("<token>:<unit>:<layer>")
# or the first token sampled ("<token>:t:<token id>").
_LANDED = re.compile(r"([0-9a-f]{16}):([0-9]{1,6}):([0-9]{1,5})")
_FIRST_TOKEN = re.compile(r"([0-9a-f]{16}):t:([0-9]{1,10})")


class TransferFailed(ConnectionError):
    """A write the engine reported as failed (peer gone, memory not registered there)."""


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """How a prefill worker reaches a decode worker's endpoint: its engine session and the
    Ray actor that grants staging slots."""

    session: str
    actor: str


@dataclass(frozen=True, slots=True)
class EngineArena:
    """A store node's host-tier arena as peers read it on the engine: `[slot, layer, k|v, ...]`
    from `base` on the session `session`."""

    session: str
    base: int
    num_slots: int
    block_bytes: int
    layer_bytes: int  # one block's K and V in one layer: contiguous, K first

    def layer_at(self, slot: int, layer: int) -> int:
        return self.base + slot * self.block_bytes + layer * self.layer_bytes


@dataclass(frozen=True, slots=True)
class Landed:
    """One landed notice as it arrived: the receive key and where it says the layer is."""

    key: str
    token: str
    unit: int
    layer: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The first token of the receive `key`, sampled by its prefill (carried by no write)."""

    key: str
    token: str
    token_id: int


def landed_message(token: str, unit: int, layer: int) -> str:
    return f"{token}:{unit}:{layer}"


def first_token_message(token: str, token_id: int) -> str:
    return f"{token}:t:{token_id}"


def parse_notice(key: str, message: str) -> Landed | FirstToken | None:
    """A notification's fields, checked; None for anything that is not one of ours."""
    if not 0 < len(key) <= 512:
        return None
    if (match := _LANDED.fullmatch(message)) is not None:
        return Landed(key, match[1], int(match[2]), int(match[3]))
    if (match := _FIRST_TOKEN.fullmatch(message)) is not None and int(match[2]) < 2**31:
        return FirstToken(key, match[1], int(match[2]))
    return None


class TransferEndpoint:
    """One process's Mooncake engine: registered memory, writes to peers, their notices."""

    def __init__(self, engine, host: str, protocol: str) -> None:
        self.engine = engine
        self.protocol = protocol
        self.session = f"{host}:{engine.get_rpc_port()}"
        self.registered: list[int] = []
        self.scratch = np.zeros(64, dtype=np.uint8)  # the source of notifications alone
        self.lock = threading.Lock()  # the counters: writes come from several threads
        self.num_writes = 0
        self.num_bytes = 0
        self.num_failed_writes = 0  # and reads
        self.num_reads = 0
        self.num_bytes_read = 0

    def counters(self) -> dict:
        return {
            "num_engine_writes": self.num_writes,
            "engine_bytes_written": self.num_bytes,
            "num_failed_engine_writes": self.num_failed_writes,
            "num_engine_reads": self.num_reads,
            "engine_bytes_read": self.num_bytes_read,
        }

    def register(self, address: int, num_bytes: int) -> None:
        """Let peers write `num_bytes` at `address` (kept until `close`)."""
        if self.engine.register_memory(address, num_bytes) != 0:
            raise TransferFailed(f"registering {num_bytes} bytes with the transfer engine failed")
        self.registered.append(address)

    def unregister(self, address: int) -> None:
        """Peers may no longer write at `address` (registered with `register`)."""
        self.engine.unregister_memory(address)
        self.registered.remove(address)

    def write(
        self,
        peer: str,
        pieces: list[tuple[int, int, int]],
        notify: tuple[str, str] | None = None,
    ) -> None:
        """Write each (local address, peer address, bytes) piece to `peer` and wait until all
        landed; `notify` (name, message) goes with the last, once the others are in."""
        if not pieces:
            return
        with self._sources_registered(pieces):
            self._write(peer, pieces, notify)
        with self.lock:
            self.num_writes += len(pieces)
            self.num_bytes += sum(p[2] for p in pieces)

    def _write(self, peer: str, pieces, notify) -> None:
        body, (src, dst, length) = pieces[:-1], pieces[-1]
        if body:
            self._check(
                self.engine.batch_transfer_sync_write(
                    peer, [p[0] for p in body], [p[1] for p in body], [p[2] for p in body]
                ),
                peer,
            )
        if notify is None:
            self._check(self.engine.transfer_sync_write(peer, src, dst, length), peer)
        else:
            from mooncake.engine import TransferNotify, TransferOpcode

            note = TransferNotify(*notify)
            self._check(
                self.engine.transfer_sync(peer, src, dst, length, TransferOpcode.Write, note),
                peer,
            )

    @contextlib.contextmanager
    def _sources_registered(self, pieces: list[tuple[int, int, int]]):
        """RDMA reads and writes only memory registered on this side too (TCP needs none):
        register the pieces' local ranges for the call. Not measured: no RDMA NIC here."""
        if self.protocol == "tcp":
            yield
            return
        ranges = merged_spans([(local, local + length) for local, _, length in pieces])
        for start, end in ranges:
            self.register(start, end - start)
        try:
            yield
        finally:
            for start, _ in ranges:
                self.unregister(start)

    def read(self, peer: str, pieces: list[tuple[int, int, int]]) -> None:
        """Read each (local address, peer address, bytes) piece from `peer`; wait for all."""
        with self._sources_registered(pieces):
            status = self.engine.batch_transfer_sync_read(
                peer, [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]
            )
        self._check(status, peer)
        with self.lock:
            self.num_reads += len(pieces)
            self.num_bytes_read += sum(p[2] for p in pieces)

    def notify(self, peer: str, address: int, name: str, message: str) -> None:
        """Send `peer` a notification alone: a write of no bytes, from memory of ours, to
        `address` (registered there)."""
        from mooncake.engine import TransferNotify, TransferOpcode

        note = TransferNotify(name, message)
        source = self.scratch.ctypes.data
        self._check(
            self.engine.transfer_sync(peer, source, address, 0, TransferOpcode.Write, note), peer
        )

    def _check(self, status: int, peer: str) -> None:
        if status != 0:
            with self.lock:
                self.num_failed_writes += 1
            raise TransferFailed(f"a transfer engine's move with {peer} failed ({status})")

    def notifies(self) -> list[tuple[str, str]]:
        """The (name, message) notifications that arrived since the last call."""
        return [(note.name, note.msg) for note in self.engine.get_notifies()]

    def close(self) -> None:
        """Unregister everything registered (peers' later writes are refused)."""
        for address in self.registered:
            self.engine.unregister_memory(address)
        self.registered.clear()


def merged_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (start, end) ranges merged where they touch or overlap."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def cluster_spans_machines() -> bool:
    """Whether the live Ray nodes have more than one address (one GCS call)."""
    return len({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}) > 1


def open_endpoint(
    settings: TransferSettings, host: str | None = None
) -> tuple[TransferEndpoint | None, str]:
    """This process's endpoint, reached at `settings.host`, else `host`, else the Ray node
    address; and the path KV takes from here: "mooncake tcp" (or rdma), or "ray (why not
    the engine)"."""
    if settings.engine == "ray":
        return None, "ray (store.transfer.engine: ray)"
    if settings.engine == "auto" and not cluster_spans_machines():
        return None, "ray (store.transfer.engine: auto, and the cluster is on one machine)"
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:  # the package, or the libibverbs/librdmacm it links
        return _fallback(f"the transfer engine cannot be imported: {error}")
    if (host := settings.host or host) is None:
        host = ray.util.get_node_ip_address()
    # Bytes per socket read or write of the TCP transport (its default 64 KiB): 1 MiB moved a
    # 64 MiB write at 2.2-2.4 GB/s instead of 1.7-1.9 on the development machine (loopback).
    os.environ.setdefault("MC_TCP_SLICE_SIZE", str(1 << 20))
    engine = TransferEngine()
    devices = "" if settings.devices == "auto" else settings.devices
    if engine.initialize(host, "P2PHANDSHAKE", settings.protocol, devices) != 0:
        return _fallback(f"the transfer engine did not start on {host} ({settings.protocol})")
    endpoint = TransferEndpoint(engine, host, settings.protocol)
    log.info("KV crosses nodes on Mooncake's transfer engine: %s", endpoint.session)
    return endpoint, f"mooncake {settings.protocol}"


def _fallback(why: str) -> tuple[None, str]:
    log.warning("%s; KV crosses nodes as Ray objects through the store", why)
    return None, f"ray ({why})"
