"""Adopting stored blocks into an engine's own pages as cached prefix pages (the target side
of the Conductor's hot-prefix replication); runs on the engine's step thread."""

from __future__ import annotations

import torch

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import Sequence
from halfmoon.kernels import ops
from halfmoon.kvstore.layout import LayerKV


def uncached_blocks(engine: LLMEngine, keys: list[bytes]) -> list[bytes]:
    """The keys of `keys` with no page of their own yet; the cached ones become most recent,
    so adopting the rest cannot evict them."""
    pool, missing = engine.pool, []
    for key in keys:
        page = pool.key_to_page.get(key)
        if page is None:
            missing.append(key)
        elif page in pool.cached_free:
            pool.cached_free.move_to_end(page)
    return missing


def adopt_blocks(engine: LLMEngine, keys: list[bytes], layers: list[LayerKV]) -> int:
    """Copy the blocks of `keys` (K/V of every layer in `layers`) into free pages and register
    them as cached prefix pages, publishing `stored` events; returns how many were adopted.
    Blocks cached meanwhile are skipped, and no more are taken than there are free pages."""
    pool = engine.pool
    rows = [i for i, key in enumerate(keys) if key not in pool.key_to_page]
    rows = rows[: pool.num_free_pages]
    if not rows:
        return 0
    # A placeholder sequence borrows the pages through the pool's public calls; releasing it
    # leaves them cached, unreferenced and evictable like any finished request's prefix.
    holder = Sequence("warm", [], 0, SamplingParams(), 0.0)
    pool.grow(holder, len(rows) * pool.block_size)
    device = engine.runner.kv_caches[0][0].device
    pages = torch.tensor(holder.block_table, device=device)
    picked = torch.tensor(rows)
    for (k_cache, v_cache), kv in zip(engine.runner.kv_caches, layers, strict=True):
        ops.scatter_pages(k_cache, pages, kv.k[picked].to(device))
        ops.scatter_pages(v_cache, pages, kv.v[picked].to(device))
    for row, page in zip(rows, holder.block_table, strict=True):
        pool.key_to_page[keys[row]] = page
        pool.page_to_key[page] = keys[row]
        if pool.events is not None:
            pool.events.append(("stored", keys[row]))
    pool.release(holder)
    return len(rows)
