"""The engine's one attention entry point: KV write, then prefill and decode attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfmoon.kernels import ops


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens go and what they attend to.

    The batch is ordered prefill runs first (`num_prefill_tokens` of them, ragged by
    `prefill_cu_seqlens_q`), then one token per decoding sequence.
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_prefix_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    # The prefill runs' lengths, on the host, when no run has a cached prefix: they then
    # attend over this step's own K/V (`ops.causal_attention`), with no page reads, unless
    # the compiled CPU prefill kernel serves (`ops.native_prefill`), faster over the pages.
    prefill_dense_lens: list[int] | None = None


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the pages, then attend: `[T, q_heads, D]` in, the same shape out."""
    ops.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    split = meta.num_prefill_tokens
    parts = []
    over_pages = meta.prefill_dense_lens is None or ops.native_prefill(query, k_cache, v_cache)
    if split > 0 and not over_pages:
        dense = (query[:split], key[:split], value[:split], meta.prefill_dense_lens, scale)
        parts.append(ops.causal_attention(*dense))
    elif split > 0:
        parts.append(
            ops.prefill_attention(
                query[:split],
                k_cache,
                v_cache,
                meta.prefill_cu_seqlens_q,
                meta.prefill_block_tables,
                meta.prefill_prefix_lens,
                scale,
            )
        )
    if split < query.shape[0]:
        parts.append(
            ops.paged_decode_attention(
                query[split:],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
