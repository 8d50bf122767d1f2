"""Distributed tiered KV store: block keys, tiers, store node, block events, wire codec.

Only light modules are re-exported here so the router and simulator import no torch;
the store node (`halfmoon.kvstore.store_node`) composes `blocks.py` and `streams.py`.
"""

from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.kvstore.errors import (
    CorruptRecord,
    KvStoreError,
    LayerTimeout,
    LayoutMismatch,
    StoreFull,
)
from halfmoon.kvstore.eviction import LruEviction
from halfmoon.kvstore.keys import block_key, block_keys, model_root_key

__all__ = [
    "BlockEvent",
    "CorruptRecord",
    "KvStoreError",
    "LayerTimeout",
    "LayoutMismatch",
    "LruEviction",
    "StoreFull",
    "block_key",
    "block_keys",
    "model_root_key",
]
