"""Pure-torch references for every kernel; the serving path on CPU and the oracle in tests.

Layouts (DESIGN.md, "KV layout"): a layer's cache is `[num_pages, block_size, num_kv_heads,
head_dim]`; a slot is `page * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write rows `key[i]`, `value[i]` ([N, kv_heads, D]) to slot `slot_mapping[i]`; -1 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence ([S, q_heads, D]) over its first `seq_lens[s]` cached tokens."""
    # A loop of SDPA over each sequence's own pages beats one padded batched gather on CPU.
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    for s, seq_len in enumerate(seq_lens.tolist()):
        pages = block_tables[s, : -(-seq_len // block_size)].long()
        keys = k_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = v_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            query[s][:, None],
            keys.to(query.dtype),
            values.to(query.dtype),
            scale=scale,
            enable_gqa=True,
        )
        out[s] = attn[:, 0]
    return out


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Ragged runs of new tokens; run s attends fully to its `prefix_lens[s]` cached tokens and
    causally to itself. The new tokens' K/V must already be in the pages (see `store_kv`)."""
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
    for s, prefix_len in enumerate(prefixes):
        start, end = starts[s], starts[s + 1]
        total = prefix_len + end - start
        pages = block_tables[s, : -(-total // block_size)].long()
        keys = k_cache[pages].flatten(0, 1)[:total].transpose(0, 1)  # [kv_heads, total, D]
        values = v_cache[pages].flatten(0, 1)[:total].transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [q_heads, n, D]
        q_pos = torch.arange(prefix_len, total, device=query.device)
        mask = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0).to(q.dtype),
            values.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    run_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Ragged runs (lengths on the host) that start at position 0: each run attends causally
    to its own `key`/`value` rows ([T, kv_heads, D]), the same as `prefill_attention` with no
    prefix, without reading the pages. torch's fused SDPA kernels do the work on any device."""
    out = torch.empty_like(query)
    start = 0
    for length in run_lens:
        end = start + length
        attn = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1).unsqueeze(0),
            key[start:end].transpose(0, 1).unsqueeze(0).to(query.dtype),
            value[start:end].transpose(0, 1).unsqueeze(0).to(query.dtype),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
        start = end
    return out


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pack the listed pages of one layer's cache into one contiguous `[n, block, H, D]` buffer."""
    return cache[page_ids.long()].contiguous()


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Unpack a buffer made by `gather_pages` into the listed pages of one layer's cache."""
    cache[page_ids.long()] = buffer.to(cache.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x + residual` (when given); returns (normed, the new residual)."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate `query` [N, q_heads, D] and `key` [N, kv_heads, D] in place, half-split (NeoX) style.

    `cos_sin_cache` is `[max_positions, D]`: cosines in the first half, sines in the second.
    """
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    for x in (query, key):
        first, second = x.float().chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat((first * c - second * s, second * c + first * s), dim=-1)
        x.copy_(rotated.to(x.dtype))
