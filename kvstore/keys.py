"""Block keys: a 128-bit hash chain over full blocks of token ids (DESIGN.md, "Block keys").

The router, the workers and the store all key KV blocks with these functions, so a
prefix computed anywhere in the cluster is found by the same key everywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

KEY_BYTES = 16


def model_root_key(
    model_id: str,
    dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> bytes:
    """The root of every chain: the model's identity and KV layout, so models never share blocks."""
    identity = f"halfmoon/v1|{model_id}|{dtype}|{num_layers}|{num_kv_heads}|{head_dim}|{block_size}"
    return hashlib.blake2b(identity.encode(), digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of one block: a hash of its parent's key and its own token ids."""
    tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent + tokens, digest_size=KEY_BYTES).digest()


def block_keys(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every full block of `token_ids`, chained from `root`; a partial tail has none."""
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
