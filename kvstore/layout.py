"""KV layout of one model and the payload of one layer of a batch of blocks."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from halfmoon.kvstore.errors import LayoutMismatch


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of the KV cache: per layer, K and V pages of `[block_size, num_kv_heads, head_dim]`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KvLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one block's K (or V) in one layer."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer."""
        return math.prod(self.page_shape) * self.dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one block's K and V in one layer."""
        return 2 * self.page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V over every layer."""
        return self.num_layers * self.layer_bytes


@dataclass(slots=True)
class LayerKV:
    """K and V of one layer for a batch of blocks, each `[num_blocks, block_size, heads, dim]`."""

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dtype != self.v.dtype or self.k.dim() != 4:
            raise LayoutMismatch(
                f"K and V must be 4-d tensors of one shape and dtype, got K {tuple(self.k.shape)} "
                f"{self.k.dtype} and V {tuple(self.v.shape)} {self.v.dtype}"
            )

    def __reduce__(self):
        # Ships raw bytes as numpy arrays so Ray moves them through shared memory without copies.
        return (
            _rebuild_layer_kv,
            (tensor_bytes(self.k), tensor_bytes(self.v), self.k.dtype, self.shape),
        )

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.k.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.k.numel() * self.k.element_size()

    @classmethod
    def empty(cls, layout: KvLayout, num_blocks: int) -> LayerKV:
        """Uninitialized K and V for `num_blocks` blocks."""
        shape = (num_blocks, *layout.page_shape)
        return cls(torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype))

    def check(self, layout: KvLayout, num_blocks: int) -> None:
        """Raise LayoutMismatch unless this holds `num_blocks` pages of `layout`."""
        expected = (num_blocks, *layout.page_shape)
        if self.shape != expected or self.k.dtype != layout.dtype:
            raise LayoutMismatch(
                f"expected K/V of shape {expected} and dtype {layout.dtype}, "
                f"got {self.shape} {self.k.dtype}"
            )


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a tensor's bytes (copied only if not contiguous or not on CPU)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def _rebuild_layer_kv(
    k: np.ndarray, v: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
) -> LayerKV:
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only; readers copy out and never write them.
        warnings.simplefilter("ignore", UserWarning)
        k_t, v_t = torch.from_numpy(k), torch.from_numpy(v)
    return LayerKV(k_t.view(dtype).view(shape), v_t.view(dtype).view(shape))
