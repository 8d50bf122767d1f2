"""Pure-torch references for every kernel; the serving path on CPU and the oracle in tests.

Layouts (DESIGN.md, "KV layout"): a layer's cache is `[num_pages, block_size, num_kv_heads,
head_dim]`; a slot is `page * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfmoon.kernels.kv_quant import as_bytes, dequantize, is_quantized, quantize


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write rows `key[i]`, `value[i]` ([N, kv_heads, D]) to slot `slot_mapping[i]`; -1 skips.
    A quantized cache (kv_quant.py) takes each row quantized, with its scale."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for rows, cache in ((key[keep], k_cache), (value[keep], v_cache)):
        if is_quantized(cache):
            rows = quantize(rows, cache.dtype)
        as_bytes(cache).view(-1, *cache.shape[2:])[slots] = as_bytes(rows.to(cache.dtype))


def widen(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as values in `dtype` (dequantized when the cache is quantized)."""
    return dequantize(rows, dtype) if is_quantized(rows) else rows.to(dtype)


# Gathered K (and as much V) per chunk of decoding sequences: within L2, and small enough that
# the allocator reuses its buffers (a bigger one is mapped and page-faulted afresh each call).
DECODE_CHUNK_BYTES = 2 << 20


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence ([S, q_heads, D]) over its first `seq_lens[s]` cached tokens.

    Longest sequences first, in chunks of about `DECODE_CHUNK_BYTES` of K: each chunk is one
    page gather padded to its longest sequence and one masked SDPA over the whole chunk."""
    lens, order = seq_lens.sort(descending=True)
    query_sorted, tables = query.index_select(0, order), block_tables.index_select(0, order)
    token_bytes = k_cache[0, 0].numel() * k_cache.element_size()
    chunks = _decode_chunks(lens.tolist(), k_cache.shape[1], token_bytes)
    parts = [_decode_chunk(query_sorted, k_cache, v_cache, tables, lens, c, scale) for c in chunks]
    out = torch.empty_like(query)
    out[order] = torch.cat(parts)
    return out


def _decode_chunks(lens: list[int], block_size: int, token_bytes: int) -> list[tuple[int, ...]]:
    """(start, end, padded width, shortest length) of each chunk of `lens` (sorted longest
    first): as many sequences as fit `DECODE_CHUNK_BYTES` of K padded to the first's pages."""
    chunks, start = [], 0
    while start < len(lens):
        width = -(-lens[start] // block_size) * block_size
        end = min(len(lens), start + max(1, DECODE_CHUNK_BYTES // (width * token_bytes)))
        chunks.append((start, end, width, lens[end - 1]))
        start = end
    return chunks


def _decode_chunk(query, k_cache, v_cache, block_tables, seq_lens, chunk, scale):
    """Decode attention of the sequences [start, end) of `chunk` (`_decode_chunks`) over `width`
    tokens of pages (a whole number of them), masked past each sequence's length; a KV head's
    query heads are its query rows, so GQA copies nothing."""
    start, end, width, min_len = chunk
    query, block_tables, seq_lens = query[start:end], block_tables[start:end], seq_lens[start:end]
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    pages = block_tables[:, : width // block_size].reshape(-1).long().clamp(min=0)  # -1 pads

    valid, stale = None, None
    if min_len < width:
        valid = torch.arange(width, device=query.device) < seq_lens[:, None]
        stale = (~valid).flatten().nonzero().squeeze(1)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [S, kv_heads, width, D], a strided view
        rows = as_bytes(cache).flatten(1).index_select(0, pages).view(num_seqs * width, -1)
        if stale is not None:  # masked slots may hold anything, and 0 * nan is nan
            rows.index_fill_(0, stale, 0)
        rows = widen(rows.view(cache.dtype).view(num_seqs, width, num_kv_heads, -1), query.dtype)
        return rows.transpose(1, 2)

    mask = None if valid is None else valid[:, None, None, :]
    attn = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, -1, head_dim),
        gather(k_cache),
        gather(v_cache),
        attn_mask=mask,
        scale=scale,
    )
    return attn.reshape(num_seqs, num_q_heads, head_dim)


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
        keys = widen(_context(k_cache, pages, total), query.dtype)
        values = widen(_context(v_cache, pages, total), query.dtype)
        q = query[start:end].transpose(0, 1)  # [q_heads, n, D]
        mask = None  # no prefix: plain causal, which skips the blocks above the diagonal
        if prefix_len:
            q_pos = torch.arange(prefix_len, total, device=query.device)
            mask = torch.arange(total, device=query.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def _context(cache: torch.Tensor, pages: torch.Tensor, total: int) -> torch.Tensor:
    """The first `total` tokens on `pages` as `[kv_heads, total, D]` (a strided view)."""
    rows = as_bytes(cache).flatten(1).index_select(0, pages).view(cache.dtype)  # a memcpy a page
    return rows.view(-1, *cache.shape[2:])[:total].transpose(0, 1)


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
    return as_bytes(cache)[page_ids.long()].contiguous().view(cache.dtype)


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Unpack a buffer made by `gather_pages` into the listed pages of one layer's cache."""
    as_bytes(cache)[page_ids.long()] = as_bytes(buffer.to(cache.dtype))


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times its second half (SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
