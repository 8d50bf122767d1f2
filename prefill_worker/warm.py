"""Adopting stored blocks into an engine's own pages as cached prefix pages (the target side
of the Conductor's hot-prefix replication); runs on the engine's step thread."""

from __future__ import annotations

import torch

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.kernels import ops
from halfmoon.kvstore.layout import LayerKV


def adopt_blocks(engine: LLMEngine, keys: list[bytes], layers: list[LayerKV]) -> int:
    """Copy the blocks of `keys` (K/V of every layer in `layers`) into pages the pool adopts
    as cached prefix pages (publishing `stored` events); returns how many were adopted.
    Blocks cached meanwhile are skipped, and no more are taken than there are free pages."""
    adopted = engine.pool.adopt(keys)
    if not adopted:
        return 0
    device = engine.runner.kv_caches[0][0].device
    rows = torch.tensor([row for row, _ in adopted])
    pages = torch.tensor([page for _, page in adopted], device=device)
    for (k_cache, v_cache), kv in zip(engine.runner.kv_caches, layers, strict=True):
        ops.scatter_pages(k_cache, pages, kv.k[rows].to(device))
        ops.scatter_pages(v_cache, pages, kv.v[rows].to(device))
    return len(adopted)
