"""The KV cache of a tensor-parallel engine, whole-head: rank r holds KV heads
`[r * H / T, (r + 1) * H / T)` in pages of its own; on CPU every rank allocates them in an
anonymous memory file (`create_shared_kv`) that rank 0 maps. So rank 0 reads and writes every
rank's heads with plain copies, with no collective and no step of the other ranks: a layer read
gathers them side by side into the full-head layout the store and the workers use, a write
gives each rank its heads. Blocks are full-head at every degree, and a block one degree stored
is loaded by another.

Ordering is as at T = 1: the other ranks write a layer's KV before that layer's all-reduce, so
it is in their pages by the time rank 0's `after_layer` runs; a write for `before_layer` is
waited for by the other ranks (the step's `wait_before_layers`, model_runner.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from halfmoon.engine.kv_cache import HostLayer, KvExport, LayerWrite, PagedKvCache, PeerKv
from halfmoon.kernels import ops
from halfmoon.kvstore.layout import LayerKV

Layers = list[tuple[torch.Tensor, torch.Tensor]]


class ShardedKvCache(PagedKvCache):
    """Per rank, per layer, K and V of `[num_pages, block_size, num_kv_heads / T, head_dim]`,
    read and written as if it were one cache of every head. `shards` holds rank 0's only where
    the others' pages cannot be mapped (CUDA, or no `memfd_create`): its KV API and copies on
    write then refuse (`unmapped` says why), and the engine takes no request with `n` > 1."""

    def __init__(self, shards: list[Layers], num_ranks: int) -> None:
        super().__init__(shards[0])
        self.shards, self.num_ranks = shards, num_ranks

    @property
    def page_shape(self) -> tuple[int, ...]:
        pages, block, heads, head_dim = self.layers[0][0].shape
        return pages, block, heads * self.num_ranks, head_dim

    @property
    def page_layer_bytes(self) -> int:
        return super().page_layer_bytes * self.num_ranks

    @property
    def unmapped(self) -> str | None:
        if len(self.shards) == self.num_ranks:
            return None
        return (
            f"the other ranks' KV pages (tensor_parallel_size={self.num_ranks}, on "
            f"{self.device.type}) are not mapped into rank 0, which works on CPU with "
            "memfd_create only so far"
        )

    def export(self) -> KvExport | None:
        return None  # lending pages needs tensor_parallel_size = 1 (EngineConfig.share_kv)

    def read_layer(
        self, layer: int, pages: Sequence[int], after: torch.cuda.Event | None = None
    ) -> HostLayer:
        """K and V of `pages` in `layer`, every rank's heads side by side."""
        index = self._whole_index(pages)
        parts = [shard[layer] for shard in self.shards]
        k = torch.cat([ops.gather_pages(k, index) for k, _ in parts], dim=2)
        v = torch.cat([ops.gather_pages(v, index) for _, v in parts], dim=2)
        return HostLayer(LayerKV(k, v))

    def write_layer(self, layer: int, pages, kv: LayerKV, *, ordered=True, after=None):
        """`PagedKvCache.write_layer`: full-head K and V of `pages` into `layer`, each rank its
        heads (synchronous on CPU, so `ordered` and `after` change nothing)."""
        self._scatter(layer, self._whole_index(pages), kv.k, kv.v)
        return LayerWrite()

    def copy_pages(self, layer: int, peer: PeerKv, src_pages, dst_pages, after=None):
        """`PagedKvCache.copy_pages`: a one-rank peer's full-head pages into this cache's, each
        rank its heads."""
        k_src, v_src = peer.layers[layer]
        src = self._index(src_pages)
        k, v = ops.gather_pages(k_src, src), ops.gather_pages(v_src, src)
        self._scatter(layer, self._whole_index(dst_pages), k, v)
        return LayerWrite()

    def copy_within(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
        src, dst = self._whole_index(src_pages), self._index(dst_pages)
        for shard in self.shards:
            for k_cache, v_cache in shard:
                ops.scatter_pages(k_cache, dst, ops.gather_pages(k_cache, src))
                ops.scatter_pages(v_cache, dst, ops.gather_pages(v_cache, src))

    def _scatter(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        heads = self.layers[0][0].shape[2]
        k, v = k.to(self.device, self.dtype), v.to(self.device, self.dtype)
        for rank, shard in enumerate(self.shards):
            k_cache, v_cache = shard[layer]
            ops.scatter_pages(k_cache, index, k[:, :, rank * heads : (rank + 1) * heads])
            ops.scatter_pages(v_cache, index, v[:, :, rank * heads : (rank + 1) * heads])

    def _whole_index(self, pages: Sequence[int]) -> torch.Tensor:
        if self.unmapped is not None:
            raise NotImplementedError(
                f"moving KV in or out of this engine is not supported yet: {self.unmapped}; "
                "use tensor_parallel_size = 1 for this worker"
            )
        return self._index(pages)


def whole_cache(layers: Layers, paths: list[str | None], map_shard) -> ShardedKvCache:
    """Rank 0's `layers` and every other rank's, mapped by `map_shard(path)` from the memory
    file each reported (`paths`; None where it could not share its pages)."""
    num_ranks = 1 + len(paths)
    if any(path is None for path in paths):
        return ShardedKvCache([layers], num_ranks)
    return ShardedKvCache([layers, *map(map_shard, paths)], num_ranks)
