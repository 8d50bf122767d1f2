"""The engine's paged KV tensors behind a small API: read a layer of some pages, write a layer into
some pages, copy a layer of pages out of another engine's cache on this node. Workers move KV
only through it, so device placement, dtype and copy streams live here and nowhere else.

Another process of the same node can open an engine's cache (`export` / `open_peer`): on CPU
it lives in an anonymous memory file the other process maps; on CUDA the other process opens
its allocations through CUDA IPC handles (torch's `reduce_tensor`), which works between
processes on the same GPU. A decode worker copies a prompt's KV straight out of the prefill
worker's pages this way, one copy, without staging it in host memory (the device tier).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from halfmoon.engine.cuda_events import waited_event
from halfmoon.engine.device_copy import device_tensor
from halfmoon.kernels import ops
from halfmoon.kvstore.layout import KvLayout, LayerKV
from halfmoon.kvstore.shared_arena import create_arena


@dataclass(frozen=True, slots=True)
class KvExport:
    """How another process on this node opens an engine's KV cache (`PagedKvCache.open_peer`).

    `path`: on CPU, the memory file every layer lives in, as `[layer, k|v, page, ...]`.
    `device_uuid` and `handles`: on CUDA, the GPU and, per layer, the arguments torch's
    `rebuild_cuda_tensor` takes for K and for V (from `reduce_tensor`)."""

    num_layers: int
    page_shape: tuple[int, ...]  # num_pages, block_size, num_kv_heads, head_dim
    dtype: str
    path: str | None = None
    device_uuid: str | None = None
    handles: tuple = ()


@dataclass(slots=True)
class PeerKv:
    """Another engine's KV cache, opened in this process: per layer its K and V pages."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_pages(self) -> int:
        return self.layers[0][0].shape[0]


def create_shared_kv(
    num_layers: int, page_shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """Zeroed KV pages `[layer, k|v, *page_shape]` in an anonymous memory file: the path other
    processes map it by, and per layer its K and V; None where the platform cannot (then
    allocate privately)."""
    shape = (num_layers, 2, *page_shape)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    arena = create_arena(num_bytes)
    if arena is None:
        return None
    memory, path = arena
    return path, _as_layers(memory.view(dtype).view(shape))


def map_shared_kv(
    path: str, num_layers: int, page_shape: tuple[int, ...], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer K and V of the KV pages another process made with `create_shared_kv`."""
    shape = (num_layers, 2, *page_shape)
    pages = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype)
    return _as_layers(pages.view(shape))


def _as_layers(pages: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`[layer, k|v, ...]` pages as per layer (K, V)."""
    return [(pages[layer, 0], pages[layer, 1]) for layer in range(len(pages))]


@dataclass(slots=True)
class HostLayer:
    """One layer of some pages on its way to host memory; `wait()` returns it once landed."""

    kv: LayerKV
    copied: torch.cuda.Event | None = None

    def wait(self) -> LayerKV:
        if self.copied is not None:
            self.copied.synchronize()
        return self.kv


@dataclass(slots=True)
class LayerWrite:
    """A layer written into pages; on CUDA it lands on the side stream, so `done()` / `wait()`
    say when (on CPU it has landed on return)."""

    copied: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.copied is None or self.copied.query()

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


class PagedKvCache:
    """Per layer, K and V of `[num_pages, block_size, num_kv_heads, head_dim]` on one device."""

    def __init__(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], shared_path: str | None = None
    ) -> None:
        self.layers = layers
        self.shared_path = shared_path  # CPU: the memory file the layers live in
        self.device = layers[0][0].device
        self.dtype = layers[0][0].dtype
        cuda = self.device.type == "cuda"
        # Copies run on side streams, off the compute stream, so a step never waits on them:
        # device-to-host on one, host-to-device on the other (each direction has its own engine).
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._write_stream = torch.cuda.Stream(self.device) if cuda else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """num_pages, block_size, num_kv_heads, head_dim: the layout a layer is read in."""
        return tuple(self.layers[0][0].shape)

    @property
    def page_layer_bytes(self) -> int:
        """Bytes of K and V of one page in one layer."""
        k = self.layers[0][0]
        return 2 * k[0].numel() * k.element_size()

    @property
    def layout(self) -> KvLayout:
        """A block's layout in these pages, as the store and the wire hold it."""
        _, block_size, num_kv_heads, head_dim = self.page_shape
        return KvLayout(self.num_layers, block_size, num_kv_heads, head_dim, dtype=self.dtype)

    @property
    def unmapped(self) -> str | None:
        """Why this process cannot reach every page (the KV API and copies on write then
        refuse), or None: it can."""
        return None

    def export(self) -> KvExport | None:
        """What another process of this node needs to open this cache; None when it cannot
        (a CPU cache not allocated shared)."""
        page_shape = tuple(self.layers[0][0].shape)
        dtype = str(self.dtype)
        if self.device.type == "cpu":
            if self.shared_path is None:
                return None
            return KvExport(self.num_layers, page_shape, dtype, path=self.shared_path)
        from torch.multiprocessing.reductions import reduce_tensor

        handles = tuple((reduce_tensor(k)[1], reduce_tensor(v)[1]) for k, v in self.layers)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return KvExport(self.num_layers, page_shape, dtype, device_uuid=uuid, handles=handles)

    def open_peer(self, export: KvExport) -> PeerKv:
        """Another engine's cache from its `export`, to `copy_pages` from; ValueError saying
        why when it cannot be (another model or dtype, another device)."""
        mine = self.page_shape
        if export.num_layers != self.num_layers or tuple(export.page_shape[1:]) != mine[1:]:
            raise ValueError(
                f"its pages are {export.num_layers} x {tuple(export.page_shape)}, "
                f"these {self.num_layers} x {mine}: another model or block size"
            )
        if export.dtype != str(self.dtype):
            raise ValueError(f"its KV is {export.dtype}, this cache's {self.dtype}")
        if self.device.type == "cpu":
            if export.path is None:
                raise ValueError("it is on a GPU and this cache on the CPU")
            return PeerKv(
                map_shared_kv(export.path, export.num_layers, export.page_shape, self.dtype)
            )
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        if export.device_uuid != uuid:
            raise ValueError(f"it is on GPU {export.device_uuid}, this cache on {uuid}")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()

        def rebuild(args: tuple) -> torch.Tensor:
            args = list(args)
            args[6] = index  # the same GPU may have another index in this process
            return rebuild_cuda_tensor(*args)

        return PeerKv([(rebuild(k), rebuild(v)) for k, v in export.handles])

    def mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the compute stream (CUDA; None on CPU):
        give it to `read_layer(after=)` from another thread, wait on it before another
        process reads the pages, or, recorded just after pages were reserved, give it to
        `write_layer` / `copy_pages(after=)`: their previous readers are all before it."""
        if self._copy_stream is None:
            return None
        event = waited_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def read_layer(
        self, layer: int, pages: Sequence[int], after: torch.cuda.Event | None = None
    ) -> HostLayer:
        """K and V of `pages` (in that order) in `layer`, copied to (pinned) host memory.

        `after` (from `mark`): gather on the copy stream once that event has passed, instead
        of on the current stream (for a caller on another thread than the step's)."""
        k_cache, v_cache = self.layers[layer]
        stream = self._copy_stream
        side = stream is not None and after is not None
        if side:
            stream.wait_event(after)
        with torch.cuda.stream(stream) if side else contextlib.nullcontext():
            index = self._index(pages)
            k, v = ops.gather_pages(k_cache, index), ops.gather_pages(v_cache, index)
        if stream is None:
            return HostLayer(LayerKV(k, v))
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the gathers
        with torch.cuda.stream(stream):
            k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            k_host.copy_(k, non_blocking=True)
            v_host.copy_(v, non_blocking=True)
            k.record_stream(stream)  # keep the gathered buffers alive until the copy ran
            v.record_stream(stream)
            copied = waited_event()
            copied.record(stream)
        return HostLayer(LayerKV(k_host, v_host), copied)

    def write_layer(
        self,
        layer: int,
        pages: Sequence[int],
        kv: LayerKV,
        *,
        ordered: bool = True,
        after: torch.cuda.Event | None = None,
    ) -> LayerWrite:
        """Write K and V of `pages` (in that order) into `layer`, from any device and dtype.

        On CUDA the host-to-device copy and the scatter run on a side stream, after `after`
        (from `mark()` just after the pages were reserved) or else after all the work already
        queued on the current stream. `ordered`: work queued on the current stream from now on
        waits for the write (the caller computes on those pages next); otherwise nothing
        waits, and the caller must see `done()` before the pages are used (the decode worker
        lets a request join only then) or freed (`wait_writes`)."""
        k_cache, v_cache = self.layers[layer]
        stream = self._write_stream
        if stream is None:
            index = self._index(pages)
            ops.scatter_pages(k_cache, index, kv.k.to(self.device, self.dtype, non_blocking=True))
            ops.scatter_pages(v_cache, index, kv.v.to(self.device, self.dtype, non_blocking=True))
            return LayerWrite()
        self._after_readers(stream, after)
        with torch.cuda.stream(stream):
            index = self._index(pages)
            ops.scatter_pages(k_cache, index, _to_device(kv.k, self.device).to(self.dtype))
            ops.scatter_pages(v_cache, index, _to_device(kv.v, self.device).to(self.dtype))
            copied = waited_event()
            copied.record(stream)
        if ordered:
            torch.cuda.current_stream(self.device).wait_event(copied)
        return LayerWrite(copied)

    def copy_pages(
        self,
        layer: int,
        peer: PeerKv,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        after: torch.cuda.Event | None = None,
    ) -> LayerWrite:
        """Copy `layer` of the peer's `src_pages` into this cache's `dst_pages` (pairwise), in
        one gather and one scatter on this device. The caller has made sure the peer's pages
        hold their values (its prefill worker waited for them before saying so). On CUDA it
        runs on the write stream, like `write_layer(ordered=False, after=)`: `done()` before
        the pages are used or the peer's pages given back."""
        k_src, v_src = peer.layers[layer]
        k_cache, v_cache = self.layers[layer]
        stream = self._write_stream
        if stream is not None:
            self._after_readers(stream, after)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            src, dst = self._index(src_pages), self._index(dst_pages)
            ops.scatter_pages(k_cache, dst, ops.gather_pages(k_src, src))
            ops.scatter_pages(v_cache, dst, ops.gather_pages(v_src, src))
        if stream is None:
            return LayerWrite()
        copied = waited_event()
        copied.record(stream)
        return LayerWrite(copied)

    def close_peer(self, peer: PeerKv) -> None:
        """Stop using a peer's cache (its engine went away): the copies already queued from
        it land first, then its CUDA IPC mappings are dropped, so nothing reads it later."""
        self.wait_writes()
        peer.layers.clear()

    def _after_readers(self, stream: torch.cuda.Stream, after: torch.cuda.Event | None) -> None:
        """Order the side stream after the pages' previous readers: `after` when the caller
        marked them (the write then does not wait for steps queued since), else everything
        queued on the compute stream so far."""
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_within(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        """Copy every layer of `src_pages` into `dst_pages` (pairwise) of this cache, on the
        current stream, so the step queued next reads them (copies on write)."""
        src, dst = self._index(src_pages), self._index(dst_pages)
        for k_cache, v_cache in self.layers:
            ops.scatter_pages(k_cache, dst, ops.gather_pages(k_cache, src))
            ops.scatter_pages(v_cache, dst, ops.gather_pages(v_cache, src))

    def wait_writes(self) -> None:
        """Block until every write issued so far has landed (before its pages are freed)."""
        if self._write_stream is not None:
            self._write_stream.synchronize()

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        # Without waiting: the prefill worker reads layers from inside the step.
        return device_tensor(list(pages), self.device, torch.int64)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, copied without blocking the host: host memory goes through a pinned
    staging buffer (the caching host allocator keeps it until the copy has run)."""
    if tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    if not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
