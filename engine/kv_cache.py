"""The engine's paged KV tensors behind a small API: read a layer of some pages, write a layer into
some pages. Workers move KV only through it, so device placement, dtype and copy streams live
here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from halfmoon.engine.device_copy import device_tensor
from halfmoon.kernels import ops
from halfmoon.kvstore.layout import LayerKV


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

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers
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

    def read_layer(self, layer: int, pages: Sequence[int]) -> HostLayer:
        """K and V of `pages` (in that order) in `layer`, copied to (pinned) host memory."""
        k_cache, v_cache = self.layers[layer]
        index = self._index(pages)
        k, v = ops.gather_pages(k_cache, index), ops.gather_pages(v_cache, index)
        if self._copy_stream is None:
            return HostLayer(LayerKV(k, v))
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the gathers
        with torch.cuda.stream(stream):
            k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            k_host.copy_(k, non_blocking=True)
            v_host.copy_(v, non_blocking=True)
            k.record_stream(stream)  # keep the gathered buffers alive until the copy ran
            v.record_stream(stream)
            copied = torch.cuda.Event()
            copied.record(stream)
        return HostLayer(LayerKV(k_host, v_host), copied)

    def write_layer(
        self, layer: int, pages: Sequence[int], kv: LayerKV, *, ordered: bool = True
    ) -> LayerWrite:
        """Write K and V of `pages` (in that order) into `layer`, from any device and dtype.

        On CUDA the host-to-device copy and the scatter run on a side stream, after the work
        already queued on the current stream. `ordered`: work queued on the current stream from
        now on waits for the write (the caller computes on those pages next); otherwise nothing
        waits, and the caller must see `done()` before the pages are used (the decode worker
        lets a request join only then) or freed (`wait_writes`)."""
        k_cache, v_cache = self.layers[layer]
        stream = self._write_stream
        if stream is None:
            index = self._index(pages)
            ops.scatter_pages(k_cache, index, kv.k.to(self.device, self.dtype, non_blocking=True))
            ops.scatter_pages(v_cache, index, kv.v.to(self.device, self.dtype, non_blocking=True))
            return LayerWrite()
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            index = self._index(pages)
            ops.scatter_pages(k_cache, index, _to_device(kv.k, self.device).to(self.dtype))
            ops.scatter_pages(v_cache, index, _to_device(kv.v, self.device).to(self.dtype))
            copied = torch.cuda.Event()
            copied.record(stream)
        if ordered:
            compute.wait_event(copied)
        return LayerWrite(copied)

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
