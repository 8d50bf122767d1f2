"""Adopting stored blocks into an engine's own pages as cached prefix pages (the target side
of the Conductor's hot-prefix replication); runs on the engine's step thread."""

from __future__ import annotations

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.kvstore.layout import LayerKV


def adopt_blocks(engine: LLMEngine, keys: list[bytes], layers: list[LayerKV]) -> int:
    """Copy the blocks of `keys` (K/V of every layer in `layers`) into pages the pool adopts
    as cached prefix pages (publishing `stored` events); returns how many were adopted.
    Blocks cached meanwhile are skipped, and no more are taken than there are free pages."""
    adopted = engine.pool.adopt(keys)
    if not adopted:
        return 0
    rows = [row for row, _ in adopted]
    pages = [page for _, page in adopted]
    for layer, kv in enumerate(layers):
        engine.kv.write_layer(layer, pages, LayerKV(kv.k[rows], kv.v[rows]))
    return len(adopted)
