"""A decode worker's staging region: host memory registered with its transfer endpoint, into
which prefill workers on other nodes write a receive's KV, and the grants that say where.

The region is laid out layer-major, `[layer, k|v, slot, block_size, heads, head_dim]`, so one
layer's K (or V) of a unit's blocks is one contiguous run of the slots granted to it: a unit's
layer lands in two writes (K, V) whatever its number of blocks, and is read back as two views
without a copy. A grant is one run of consecutive slots, a block of the prompt per slot.

A grant whose receive ended before every layer landed (aborted, its prefill gone) is not given
out again at once: a prefill worker that has not heard may still write into it. Its slots wait
`quarantine_s` (30 s: past the prefill's publish of any layer it had begun) before reuse.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import torch

from halfmoon.kvstore.layout import KvLayout, LayerKV

QUARANTINE_S = 30.0


@dataclass(frozen=True, slots=True)
class Grant:
    """Where a prefill worker may write one receive's KV: `num_blocks` slots from
    `first_slot` of the staging region at `base` on the engine session `session`, and the
    token its landed notices must carry."""

    session: str
    token: str
    base: int
    num_slots: int  # of the whole region: the stride between a layer's K, V and next layer
    page_bytes: int
    first_slot: int
    num_blocks: int

    def places(self, layer: int, first_block: int) -> tuple[int, int]:
        """Peer addresses of layer `layer`'s K and V for blocks `first_block...` (the caller
        checks the blocks are in the grant: `holds`)."""
        slot = self.first_slot + first_block
        k = self.base + ((2 * layer) * self.num_slots + slot) * self.page_bytes
        return k, k + self.num_slots * self.page_bytes

    def holds(self, first_block: int, num_blocks: int) -> bool:
        return first_block >= 0 and first_block + num_blocks <= self.num_blocks


class StagingArea:
    """The registered region and its slots: granted as runs, given back clean or quarantined."""

    def __init__(
        self, layout: KvLayout, num_bytes: int, endpoint, quarantine_s: float = QUARANTINE_S
    ) -> None:
        self.layout = layout
        self.num_slots = num_bytes // layout.block_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"store.transfer.staging_bytes {num_bytes} holds no block of "
                f"{layout.block_bytes} bytes"
            )
        shape = (layout.num_layers, 2, self.num_slots, *layout.page_shape)
        self.pages = torch.zeros(shape, dtype=layout.dtype)
        self.endpoint = endpoint
        endpoint.register(self.pages.data_ptr(), self.pages.numel() * self.pages.element_size())
        self.quarantine_s = quarantine_s
        self.free: list[tuple[int, int]] = [(0, self.num_slots)]  # (first slot, length), sorted
        self.quarantined: list[tuple[float, int, int]] = []  # (until, first slot, length)
        self.num_grants = 0
        self.num_full = 0  # receives that found no run of slots free: through the store

    def counters(self) -> dict:
        return {
            "num_staging_grants": self.num_grants,
            "num_staging_full": self.num_full,
            "staging_slots_free": sum(length for _, length in self.free),
        }

    def grant(self, num_blocks: int) -> Grant | None:
        """A run of `num_blocks` slots, or None when none is free."""
        self._thaw()
        for index, (first, length) in enumerate(self.free):
            if length >= num_blocks:
                rest = (first + num_blocks, length - num_blocks)
                self.free[index : index + 1] = [rest] if rest[1] else []
                self.num_grants += 1
                return Grant(
                    self.endpoint.session,
                    secrets.token_hex(8),
                    self.pages.data_ptr(),
                    self.num_slots,
                    self.layout.page_bytes,
                    first,
                    num_blocks,
                )
        self.num_full += 1
        return None

    def layer(self, grant: Grant, layer: int, first_block: int, num_blocks: int) -> LayerKV:
        """Views of layer `layer` of blocks `first_block...` as they landed (no copy)."""
        start = grant.first_slot + first_block
        stop = start + num_blocks
        return LayerKV(self.pages[layer, 0, start:stop], self.pages[layer, 1, start:stop])

    def release(self, grant: Grant, clean: bool) -> None:
        """Give the grant's slots back: at once when every write into them is done (`clean`),
        else after the quarantine."""
        run = (grant.first_slot, grant.num_blocks)
        if clean:
            self._free(*run)
        else:
            self.quarantined.append((time.monotonic() + self.quarantine_s, *run))

    def _thaw(self) -> None:
        now = time.monotonic()
        ready = [entry for entry in self.quarantined if entry[0] <= now]
        self.quarantined = [entry for entry in self.quarantined if entry[0] > now]
        for _, first, length in ready:
            self._free(first, length)

    def _free(self, first: int, length: int) -> None:
        """Put a run back, merged with its free neighbours."""
        runs = sorted([*self.free, (first, length)])
        merged: list[tuple[int, int]] = []
        for start, size in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged

    def close(self) -> None:
        """Unregister the region: peers' later writes into it are refused."""
        self.endpoint.unregister(self.pages.data_ptr())
