"""The two actors of `halfmoon bench rdt`: a sender holding one request's KV, a receiver with
pages to fill, joined by the path under test (store node, shared arena, Ray object arguments,
Ray Direct Transport over gloo, CUDA IPC or NCCL)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import ray
import torch

from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.shared_arena import map_arena

TWO_SIDED = {"gloo", "nccl"}  # collective send/recv; cuda_ipc is one-sided
# A transfer RDT cannot finish fails after this (Ray's default, 60 s, then kills both actors).
RDT_TIMEOUT_MS = 20_000
GET_TIMEOUT_S = 30.0


class Sender:
    """Plays the prefill worker: holds one request's KV and sends it one layer at a time."""

    def __init__(self, layout: KvLayout, max_blocks: int, device: str, seed: int) -> None:
        torch.set_num_threads(1)
        generator = torch.Generator().manual_seed(seed)
        shape = (layout.num_layers, max_blocks, *layout.page_shape)
        self.k = torch.randn(shape, generator=generator).to(device, layout.dtype)
        self.v = torch.randn(shape, generator=generator).to(device, layout.dtype)
        self.num_layers = layout.num_layers
        self.device = device

    async def connect(self, receiver, store, backend: str | None) -> None:
        """Remember the peers; with `backend`, join a collective group with the receiver."""
        self.me = ray.get_runtime_context().current_actor
        self.receiver, self.store = receiver, store
        node_id = ray.get_runtime_context().get_node_id()
        self.arena = map_arena(await store.arena_info.remote(), node_id)
        if backend is not None:
            from ray.experimental.collective import create_collective_group

            # It ray.get's this actor's own methods, so it must not block the event loop.
            group = [self.me, receiver]
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: create_collective_group(group, backend=backend)
            )

    def read(self, layer: int, num_blocks: int, device: str | None = None) -> LayerKV:
        """A copy of one layer's pages, as the prefill worker's `read_layer` makes."""
        device = device or self.device
        k = self.k[layer, :num_blocks].to(device, copy=True)
        return LayerKV(k, self.v[layer, :num_blocks].to(device, copy=True))

    async def emit(self, layer: int, num_blocks: int, device: str) -> tuple:
        """One layer as bare tensors: RDT moves tensors, not LayerKV's numpy bytes."""
        kv = self.read(layer, num_blocks, device)
        return kv.k, kv.v

    async def request(self, path: str, num_blocks: int) -> float:
        """Send one request's KV by `path`; seconds until the receiver holds every layer."""
        start = time.perf_counter()
        if path == "store":
            await self._via_store(num_blocks)
        elif path == "shared":
            await self._via_shared(num_blocks)
        elif path == "object":
            layers = range(self.num_layers)
            await asyncio.gather(
                *[self.receiver.take.remote(i, self.read(i, num_blocks)) for i in layers]
            )
        else:
            await self._via_rdt(path, num_blocks)
        return time.perf_counter() - start

    async def _via_store(self, num_blocks: int) -> None:
        keys = [os.urandom(16) for _ in range(num_blocks)]
        received = self.receiver.from_store.remote(self.store, keys)
        puts = [
            self.store.put_layer.remote(keys, layer, self.read(layer, num_blocks))
            for layer in range(self.num_layers)
        ]
        await asyncio.gather(received, *puts)

    async def _via_shared(self, num_blocks: int) -> None:
        # As the prefill worker does on its own node: claim the slots, copy each layer into
        # the store's shared arena, and tell the store (no layer crosses Ray's object store).
        keys = [os.urandom(16) for _ in range(num_blocks)]
        received = self.receiver.from_arena.remote(self.store, keys)
        slots, lease_id = await self.store.claim.remote(keys)
        notices = []
        for layer in range(self.num_layers):
            self.arena.write(slots, layer, self.read(layer, num_blocks, "cpu"))
            last = lease_id if layer == self.num_layers - 1 else None
            notices.append(self.store.layer_written.remote(keys, layer, slots, last))
        await asyncio.gather(received, *notices)

    async def _via_rdt(self, transport: str, num_blocks: int) -> None:
        # The sender returns the tensors from its own RDT method and hands the ref to the
        # receiver as a task argument: Ray refuses ray.put for two-sided transports.
        device = "cpu" if transport == "gloo" else self.device
        emit = self.me.emit.options(tensor_transport=transport)
        if transport in TWO_SIDED:
            # Ray 2.60 sends and receives untagged: two layers in flight may land swapped.
            for layer in range(self.num_layers):
                await self.receiver.take.remote(layer, emit.remote(layer, num_blocks, device))
            return
        refs = [emit.remote(layer, num_blocks, device) for layer in range(self.num_layers)]
        await asyncio.gather(*[self.receiver.take.remote(i, ref) for i, ref in enumerate(refs)])

    async def sent(self, num_blocks: int) -> list[LayerKV]:
        """The first `num_blocks` pages of every layer, on the CPU."""
        return [self.read(layer, num_blocks, "cpu") for layer in range(self.num_layers)]


class Receiver:
    """Plays the decode worker: writes each layer it receives into its own KV buffer."""

    def __init__(self, layout: KvLayout, max_blocks: int, device: str) -> None:
        torch.set_num_threads(1)
        shape = (layout.num_layers, max_blocks, *layout.page_shape)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.num_layers = layout.num_layers

    async def take(self, layer: int, kv: LayerKV | tuple) -> None:
        k, v = (kv.k, kv.v) if isinstance(kv, LayerKV) else kv
        self.k[layer, : len(k)].copy_(k)
        self.v[layer, : len(v)].copy_(v)
        if self.k.is_cuda:
            torch.cuda.current_stream().synchronize()  # the layer is in place, not queued

    async def from_store(self, store, keys: list[bytes]) -> None:
        """Every layer of `keys` from the store node, one stream as the decode worker reads."""
        stream = store.stream_layers.options(num_returns="streaming").remote(
            [keys], self.num_layers, GET_TIMEOUT_S
        )
        for layer in range(self.num_layers):
            await self.take(layer, await (await anext(stream)))

    async def from_arena(self, store, keys: list[bytes]) -> None:
        """Every layer of `keys` copied out of the store node's shared arena, as the decode
        worker on the store's node reads: one stream of (slots, lease), ended once copied."""
        if not hasattr(self, "arena"):
            node_id = ray.get_runtime_context().get_node_id()
            self.arena = map_arena(await store.arena_info.remote(), node_id)
        stream_id = os.urandom(8).hex()
        stream = store.stream_slots.options(num_returns="streaming").remote(
            [keys], self.num_layers, GET_TIMEOUT_S, stream_id
        )
        for layer in range(self.num_layers):
            slots, _ = await (await anext(stream))
            await self.take(layer, self.arena.read(slots, layer))
        await store.end_stream.remote(stream_id)

    async def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()

    async def received(self, num_blocks: int) -> list[LayerKV]:
        """The first `num_blocks` pages of every layer, on the CPU."""
        return [
            LayerKV(self.k[layer, :num_blocks].cpu(), self.v[layer, :num_blocks].cpu())
            for layer in range(self.num_layers)
        ]


@dataclass(slots=True)
class Pair:
    """A sender and a receiver actor, joined by the collective `backend` when it has one."""

    sender: ray.actor.ActorHandle
    receiver: ray.actor.ActorHandle


def start_pair(
    layout: KvLayout, max_blocks: int, device: str, store, backend: str | None, gpus: float = 0
) -> Pair:
    """Two RDT-enabled actors (both must be, or a transfer hangs until RDT_TIMEOUT_MS)."""
    env = {"RAY_rdt_fetch_fail_timeout_milliseconds": str(RDT_TIMEOUT_MS)}
    options = {
        "num_cpus": 0,
        "num_gpus": gpus,
        "enable_tensor_transport": True,
        "runtime_env": {"env_vars": env},
    }
    sender = ray.remote(**options)(Sender).remote(layout, max_blocks, device, seed=0)
    receiver = ray.remote(**options)(Receiver).remote(layout, max_blocks, device)
    ray.get(sender.connect.remote(receiver, store, backend))
    return Pair(sender, receiver)


def delivered_intact(pair: Pair, path: str, num_blocks: int) -> bool:
    """Send one request by `path` into a cleared receiver; True when it holds the sent bytes."""
    ray.get(pair.receiver.clear.remote())
    ray.get(pair.sender.request.remote(path, num_blocks))
    sent = ray.get(pair.sender.sent.remote(num_blocks))
    got = ray.get(pair.receiver.received.remote(num_blocks))
    layers = zip(sent, got, strict=True)
    return all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in layers)
