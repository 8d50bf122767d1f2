"""Paged KV bookkeeping: reference-counted pages and the automatic prefix cache.

A page whose block is full is registered under its block key. When its last reader lets
go it stays cached, on an LRU list, until a new allocation needs it.

The sequences of one request (`n` > 1) share the prompt's pages (`fork`): one reference each.
The last page, when partial, is copied on write: a sequence about to decode into a page that
another still reads takes a fresh page instead (`grow`), and the engine copies the KV over
(`take_copies`) before the step runs; the last one left writes in place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from halfmoon.engine.sequence import Sequence
from halfmoon.kvstore.keys import block_key


class PagePool:
    """Allocates pages to sequences and finds cached prefixes by block key."""

    def __init__(
        self, num_pages: int, block_size: int, root_key: bytes, enable_caching: bool = True
    ) -> None:
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.block_size = block_size
        self.root_key = root_key
        self.ref_counts = [0] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.key_to_page: dict[bytes, int] = {}
        self.page_to_key: dict[int, bytes] = {}
        # (kind, key) of blocks entering and leaving the cache, for a cluster-wide index.
        self.events: list[tuple[str, bytes]] | None = None
        # Pages lent to another process (a prefill worker's to a decode worker that copies them):
        # `hold` keeps them from being reused; `unhold_later` may come from any thread and takes
        # effect at the next `drain_unholds` (the engine's next step).
        self.num_held_pages = 0
        self._unholds: deque[list[int]] = deque()
        self._unholds_lock = threading.Lock()
        # (source, destination) of the copies on write since the last `take_copies`.
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages) + len(self.cached_free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        new = max(0, -(-num_tokens // self.block_size) - len(seq.block_table))
        return new + (self._shared_write_page(seq) is not None)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough pages to hold `num_tokens` tokens, and a page of its own for the
        one it writes next if a sibling still reads that one (copy on write)."""
        index = self._shared_write_page(seq)
        if index is not None:
            shared, own = seq.block_table[index], self._allocate()
            # A new list, never an edit: the decode graphs mirror block tables by identity.
            seq.block_table = [*seq.block_table[:index], own, *seq.block_table[index + 1 :]]
            self._drop(shared)
            self._copies.append((shared, own))
        for _ in range(-(-num_tokens // self.block_size) - len(seq.block_table)):
            seq.block_table.append(self._allocate())

    def fork(self, seq: Sequence, sibling: Sequence) -> None:
        """Give `sibling` every page of `seq` (its prompt), one more reference each."""
        for page in seq.block_table:
            self._acquire(page)
        sibling.block_table = list(seq.block_table)
        sibling.num_cached_blocks = seq.num_cached_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """(source, destination) pages whose KV must be copied before the next step runs:
        the copies on write `grow` made since the last call."""
        # A page given up and taken again within one step keeps only its last copy.
        latest = {dst: src for src, dst in self._copies}
        self._copies = []
        return [(src, dst) for dst, src in latest.items()]

    def _shared_write_page(self, seq: Sequence) -> int | None:
        """Index in `seq`'s block table of the page its next decode token goes to, when
        another sequence holds it too (a sibling's shared prompt tail); else None. Prompt
        writes are never copied: the only pages a prompt shares are whole cached blocks and
        pages lent while it computes (`hold`)."""
        position = seq.num_computed_tokens
        index = position // self.block_size
        if position < seq.num_prompt_tokens or index >= len(seq.block_table):
            return None
        return index if self.ref_counts[seq.block_table[index]] > 1 else None

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Point `seq` at the cached pages of its longest cached prefix; returns tokens reused.

        At least one token is left to compute, so the step that finishes the prompt has logits.
        """
        if not self.enable_caching:
            seq.num_computed_tokens = 0
            return 0
        num_blocks = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, num_blocks)
        pages: list[int] = []
        for key in seq.block_keys[:num_blocks]:
            page = self.key_to_page.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._acquire(page)
        seq.block_table = pages
        seq.num_cached_blocks = len(pages)
        seq.num_computed_tokens = len(pages) * self.block_size
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that became full and computed since the last call."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        self._hash_blocks(seq, num_full)
        for index in range(seq.num_cached_blocks, num_full):
            key, page = seq.block_keys[index], seq.block_table[index]
            if key not in self.key_to_page and page not in self.page_to_key:
                self.key_to_page[key] = page
                self.page_to_key[page] = key
                if self.events is not None:
                    self.events.append(("stored", key))
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend `seq.block_keys` to its first `num_blocks` blocks, hashing only those
        without a known key (a step's hot path: no copy of the keys already there)."""
        keys, size = seq.block_keys, self.block_size
        for index in range(len(keys), num_blocks):
            parent = keys[-1] if keys else self.root_key
            keys.append(block_key(parent, seq.token_ids[index * size : (index + 1) * size]))

    def uncached(self, keys: list[bytes]) -> list[bytes]:
        """The keys of `keys` without a cached page; the cached ones become most recently
        used, so adopting the rest does not evict them."""
        missing = []
        for key in keys:
            page = self.key_to_page.get(key)
            if page is None:
                missing.append(key)
            elif page in self.cached_free:
                self.cached_free.move_to_end(page)
        return missing

    def adopt(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """Register a free page under each key of `keys` not cached yet, as if a request had
        computed it and finished: cached, unreferenced, evictable. Returns (index in `keys`,
        page) of each; the caller writes their KV before the next step. It evicts only cached
        pages outside `keys`, never one of the chain it extends nor one it adopted itself."""
        adopted: list[tuple[int, int]] = []
        held = [self.key_to_page[key] for key in keys if key in self.key_to_page]
        protected = 0
        for page in held:
            if page in self.cached_free:
                self.cached_free.move_to_end(page)
                protected += 1
        budget = self.num_free_pages - protected
        for index, key in enumerate(keys):
            if len(adopted) == budget:
                break
            if key in self.key_to_page:
                continue
            page = self._allocate()
            self.ref_counts[page] = 0
            self.key_to_page[key] = page
            self.page_to_key[page] = key
            self.cached_free[page] = None
            if self.events is not None:
                self.events.append(("stored", key))
            adopted.append((index, page))
        return adopted

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its pages; the tail goes first so prefixes are evicted last."""
        for page in reversed(seq.block_table):
            self._drop(page)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def hold(self, pages: list[int]) -> None:
        """One more reference on each of `pages` (in use by a sequence), so they are neither
        freed nor evicted until `unhold_later(pages)` has been drained."""
        for page in pages:
            if self.ref_counts[page] < 1:
                raise ValueError(f"page {page} is not in use: only a sequence's pages can be held")
            self._acquire(page)
        self.num_held_pages += len(pages)

    def unhold_later(self, pages: list[int]) -> None:
        """Give back a `hold` (thread-safe; takes effect at the next `drain_unholds`)."""
        with self._unholds_lock:
            self._unholds.append(list(pages))

    def num_still_held(self) -> int:
        """Pages held and not given back, counting `unhold_later` calls not yet drained."""
        with self._unholds_lock:
            return self.num_held_pages - sum(len(pages) for pages in self._unholds)

    def drain_unholds(self) -> None:
        """Apply the `unhold_later` calls made since the last drain (the engine's thread)."""
        while True:
            with self._unholds_lock:
                if not self._unholds:
                    return
                pages = self._unholds.popleft()
            self.num_held_pages -= len(pages)
            for page in reversed(pages):
                self._drop(page)

    def _drop(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if page in self.page_to_key:
                self.cached_free[page] = None
            else:
                self.free_pages.append(page)

    def _acquire(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            self.cached_free.pop(page, None)
        self.ref_counts[page] += 1

    def _allocate(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.cached_free.popitem(last=False)
            key = self.page_to_key.pop(page)
            del self.key_to_page[key]
            if self.events is not None:
                self.events.append(("evicted", key))
        self.ref_counts[page] = 1
        return page
