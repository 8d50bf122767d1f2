"""Shared pieces of the paged attention kernels: a run of KV tiles folded into an online softmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def attend_tiles(
    q,
    acc,
    row_max,
    row_sum,
    start,
    end,
    positions,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    dims,
    dim_mask,
    kv_head,
    block_size,
    stride_cp,
    stride_co,
    stride_ch,
    scale_log2,
    BLOCK_N: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the keys in [start, end), found page by page via a block table row, into the running
    softmax; `APPLY_MASK` hides keys past `end`, `CAUSAL` also those after each row's position."""
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        page = tl.load(table_row_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
        rows = page * stride_cp + (tokens % block_size) * stride_co + kv_head * stride_ch
        offsets = rows[:, None] + dims[None, :]
        mask = token_mask[:, None] & dim_mask[None, :]
        key = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
        value = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
        allowed = token_mask[None, :]
        if CAUSAL:
            allowed = allowed & (tokens[None, :] <= positions[:, None])
        acc, row_max, row_sum = online_softmax_step(
            q, key, value, acc, row_max, row_sum, allowed, scale_log2, APPLY_MASK, DOT_PRECISION
        )
    return acc, row_max, row_sum


@triton.jit
def online_softmax_step(
    q,
    key,
    value,
    acc,
    row_max,
    row_sum,
    allowed,
    scale_log2,
    APPLY_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one KV tile into the running (acc, row max, row sum) of flash attention, in base 2."""
    scores = tl.dot(q, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
    if APPLY_MASK:
        scores = tl.where(allowed, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(probs, 1)
    pv = tl.dot(probs.to(value.dtype), value, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, new_max, row_sum


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches keep full precision in `tl.dot` (TF32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor) -> None:
    """The attention kernels index K and V with one set of strides and a dense head dimension."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            f"K/V cache strides {k_cache.stride()} and {v_cache.stride()} must match and have a "
            "dense head dimension ([num_pages, block_size, num_kv_heads, head_dim])"
        )
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"{query.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
        )


def strides(query: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple:
    """The strides the paged kernels take, in their order: a query's token and head, a page's
    page, offset and head, and a block table's row."""
    return (*query.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0))


def head_dim_block(head_dim: int) -> int:
    """`tl.dot` needs power-of-two tiles of at least 16; padded lanes are masked."""
    return max(16, triton.next_power_of_2(head_dim))
