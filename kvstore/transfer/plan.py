"""How a prompt's KV travels from prefill to decode: fixed units of whole blocks.

Both workers derive the same plan from the prompt and its full-block keys (hashed once, by the
router), so the decode worker can wait for unit u, layer l before the prefill worker has
computed it. A unit is `chunk_tokens` of the prompt (the prefill chunk); it is put as one
`put_layer` per layer, never per block, and the decode worker reads every unit's layers back
through one `stream_layers` per request. Full blocks carry their prefix-chain keys, so what is
sent also serves as cache; a partial last block gets a key private to the request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from halfmoon.kvstore.keys import KEY_BYTES


@dataclass(slots=True)
class TransferUnit:
    """Blocks `first_block ...` of the prompt, sent together; `end_token` is where they end."""

    index: int
    first_block: int
    keys: list[bytes]
    end_token: int


def tail_key(parent: bytes, token_ids: Sequence[int], request_id: str) -> bytes:
    """Key of a partial last block: never shared, since other prompts may extend it differently."""
    payload = parent + b"|tail|" + request_id.encode() + str(list(token_ids)).encode()
    return hashlib.blake2b(payload, digest_size=KEY_BYTES).digest()


def plan_transfer(
    root_key: bytes,
    block_keys: Sequence[bytes],
    token_ids: Sequence[int],
    block_size: int,
    chunk_tokens: int,
    request_id: str,
) -> list[TransferUnit]:
    """The units of a prompt, in order; every block of the prompt is in exactly one. Only a
    partial last block's (private) key is computed here."""
    keys = list(block_keys)
    full_tokens = len(keys) * block_size
    if full_tokens < len(token_ids):
        keys.append(tail_key(keys[-1] if keys else root_key, token_ids[full_tokens:], request_id))
    blocks_per_unit = chunk_tokens // block_size
    units = []
    for index, first in enumerate(range(0, len(keys), blocks_per_unit)):
        end = min(len(token_ids), (first + blocks_per_unit) * block_size)
        units.append(TransferUnit(index, first, keys[first : first + blocks_per_unit], end))
    return units
