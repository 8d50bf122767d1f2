"""The host tier's arena in shared memory, so a producer on the same node (the prefill worker)
copies a layer straight into its slots, and a reader on the same node (the decode worker)
straight out of them, instead of shipping it through Ray's object store.

Measured on the 2-core development machine: `ray.put` of an 8 MiB layer (the ~0.9B model at
2,048 tokens) costs ~10 ms of the caller's time, a copy into the mapped arena ~1 ms.

The arena is an anonymous memory file (`memfd_create`): no name to leak in /dev/shm when the
store is killed; producers map it through `/proc/<store pid>/fd/<fd>`, and its memory goes
back to the system once the last process mapping it exits.

Its pages are allocated when it is made (`fault_in`), not by the first copy into each: a
memory file's page is allocated and cleared by the kernel at its first touch, and a
prefill worker's KV pages (made here too, `engine/kv_cache.py`) were being touched for the first
time by its forward passes, request after request: 19 % of the step thread's time in the
kernel clearing pages, on the 2-core machine (issue 51). A private KV cache is zeroed when it is
allocated; this makes the shared one cost the same, once, at start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from halfmoon.kvstore.layout import KvLayout, LayerKV


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """Where a store node's arena can be mapped from, and on which Ray node."""

    path: str
    node_id: str
    num_slots: int
    layout: KvLayout


def create_arena(num_bytes: int) -> tuple[torch.Tensor, str] | None:
    """A zeroed shared uint8 tensor of `num_bytes` and the path other processes map it by;
    None where the platform has no `memfd_create` (the arena is then private)."""
    if not hasattr(os, "memfd_create"):
        return None
    fd = os.memfd_create("halfmoon-kv-arena")
    os.ftruncate(fd, num_bytes)
    path = f"/proc/{os.getpid()}/fd/{fd}"  # the fd stays open for the process's life
    memory = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    fault_in(memory)
    return memory, path


# madvise(2) advice that faults a range in, writable, without touching it (Linux 5.14).
MADV_POPULATE_WRITE = 23


def fault_in(memory: torch.Tensor) -> None:
    """Allocate every page of a new, zeroed memory file's tensor now, so that no copy into it
    later pays the kernel's first touch (other processes that map it find its pages there and
    only map them). Where the kernel lacks MADV_POPULATE_WRITE, it is zeroed: the same faults."""
    if memory.numel() and not _madvise_populate(memory):
        memory.zero_()


def _madvise_populate(memory: torch.Tensor) -> bool:
    libc = _libc()
    if libc is None:
        return False
    start = memory.data_ptr()
    first = start - start % mmap.PAGESIZE
    length = start + memory.numel() * memory.element_size() - first
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    if libc is None or not hasattr(libc, "madvise"):
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def slot_pages(arena: torch.Tensor, layout: KvLayout, num_slots: int) -> torch.Tensor:
    """The arena as `[slot, layer, k|v, block_size, heads, head_dim]` of the layout's dtype."""
    shape = (num_slots, layout.num_layers, 2, *layout.page_shape)
    return arena[: num_slots * layout.block_bytes].view(layout.dtype).view(shape)


def copy_in(pages: torch.Tensor, slots: Sequence[int], layer: int, kv: LayerKV) -> None:
    """Copy one layer of K/V rows into `slots` of `pages` (row i into slots[i])."""
    for slot, row, length in _runs(list(slots)):
        # Slice copies run at memcpy speed; advanced-index assignment is several times slower.
        pages[slot : slot + length, layer, 0].copy_(kv.k[row : row + length])
        pages[slot : slot + length, layer, 1].copy_(kv.v[row : row + length])


def copy_out(pages: torch.Tensor, slots: Sequence[int], layer: int, pin: bool = False) -> LayerKV:
    """A private copy of one layer of `slots` of `pages` (row i from slots[i]); `pin`: into
    page-locked memory, which a CUDA copy to the device reads without staging it again."""
    index = torch.as_tensor(slots, dtype=torch.long)
    shape = (len(index), *pages.shape[3:])
    k = torch.empty(shape, dtype=pages.dtype, pin_memory=pin)
    v = torch.empty(shape, dtype=pages.dtype, pin_memory=pin)
    torch.index_select(pages[:, layer, 0], 0, index, out=k)
    torch.index_select(pages[:, layer, 1], 0, index, out=v)
    return LayerKV(k, v)


class MappedArena:
    """A producer's or reader's view of a store node's arena on its own node."""

    def __init__(self, info: ArenaInfo) -> None:
        num_bytes = info.num_slots * info.layout.block_bytes
        arena = torch.from_file(info.path, shared=True, size=num_bytes, dtype=torch.uint8)
        self.layout = info.layout
        self.pages = slot_pages(arena, info.layout, info.num_slots)

    def write(self, slots: Sequence[int], layer: int, kv: LayerKV) -> None:
        kv.check(self.layout, len(slots))
        copy_in(self.pages, slots, layer, kv)

    def read(self, slots: Sequence[int], layer: int, pin: bool = False) -> LayerKV:
        """A private copy of one layer of `slots` (the slots may be reused once released);
        `pin`: in page-locked memory (for a reader that copies it on to a CUDA device)."""
        return copy_out(self.pages, slots, layer, pin)


def map_arena(info: ArenaInfo | None, node_id: str) -> MappedArena | None:
    """The arena mapped here, or None when it is on another node or cannot be opened."""
    if info is None or info.node_id != node_id:
        return None
    try:
        return MappedArena(info)
    except (OSError, RuntimeError):
        return None


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots as (first slot, first row, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(slots) + 1):
        if row == len(slots) or slots[row] != slots[row - 1] + 1:
            runs.append((slots[start], start, row - start))
            start = row
    return runs
