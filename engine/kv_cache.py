"""The engine's paged KV tensors behind a small API: read a layer of some pages, write a layer into
some pages. Workers move KV only through it, so device placement, dtype and copy streams live
here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


class PagedKvCache:
    """Per layer, K and V of `[num_pages, block_size, num_kv_heads, head_dim]` on one device."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers
        self.device = layers[0][0].device
        self.dtype = layers[0][0].dtype
        cuda = self.device.type == "cuda"
        # Device-to-host copies run here, off the compute stream, so a step never waits on them.
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

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

    def write_layer(self, layer: int, pages: Sequence[int], kv: LayerKV) -> None:
        """Write K and V of `pages` (in that order) into `layer`, from any device and dtype."""
        k_cache, v_cache = self.layers[layer]
        index = self._index(pages)
        ops.scatter_pages(k_cache, index, kv.k.to(self.device, self.dtype))
        ops.scatter_pages(v_cache, index, kv.v.to(self.device, self.dtype))

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(pages), dtype=torch.int64, device=self.device)
