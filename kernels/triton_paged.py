"""Shared pieces of the paged attention kernels: a run of KV tiles folded into an online softmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.kv_quant import FORMAT_CODES

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
    head_dim,
    BLOCK_N: tl.constexpr,
    APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """Fold the keys in [start, end), found page by page via a block table row, into the running
    softmax; `APPLY_MASK` hides keys past `end`, `CAUSAL` also those after each row's position.
    `KV_FORMAT` (`kv_format`): 0 the caches hold values; else 8-bit rows with their scales, the
    caches given as bytes (kv_quant.py), dequantized here into q's dtype."""
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        page = tl.load(table_row_ptr + tokens // block_size, mask=token_mask, other=0).to(tl.int64)
        rows = page * stride_cp + (tokens % block_size) * stride_co + kv_head * stride_ch
        tile = (rows, dims, token_mask, dim_mask, head_dim)
        key = load_tile(k_cache_ptr, *tile, KV_FORMAT)
        value = load_tile(v_cache_ptr, *tile, KV_FORMAT)
        if KV_FORMAT != 0:  # dequantized in fp32: into the query's dtype for tl.dot
            key, value = key.to(q.dtype), value.to(q.dtype)
        allowed = token_mask[None, :]
        if CAUSAL:
            allowed = allowed & (tokens[None, :] <= positions[:, None])
        acc, row_max, row_sum = online_softmax_step(
            q, key, value, acc, row_max, row_sum, allowed, scale_log2, APPLY_MASK, DOT_PRECISION
        )
    return acc, row_max, row_sum


@triton.jit
def load_tile(cache_ptr, rows, dims, token_mask, dim_mask, head_dim, KV_FORMAT: tl.constexpr):
    """A tile of K or V rows (`rows`: each one's offset) as values; a quantized cache's rows
    dequantized into fp32, each by its fp16 scale (the 2 bytes after its values)."""
    mask = token_mask[:, None] & dim_mask[None, :]
    raw = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0)
    if KV_FORMAT == 0:
        return raw
    low = tl.load(cache_ptr + rows + head_dim, mask=token_mask, other=0).to(tl.uint16)
    high = tl.load(cache_ptr + rows + head_dim + 1, mask=token_mask, other=0).to(tl.uint16)
    scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return dequantize(raw, KV_FORMAT) * scale[:, None]


@triton.jit
def dequantize(raw, KV_FORMAT: tl.constexpr):
    """8-bit codes (uint8) as fp32: int8 values, or an fp8 byte placed in an fp16's bits (e5m2
    is an fp16's top byte; e4m3's exponent and mantissa sit 7 bits up, reading 2^8 too small)."""
    if KV_FORMAT == 1:
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    wide = raw.to(tl.uint16)
    if KV_FORMAT == 2:
        bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return (wide << 8).to(tl.float16, bitcast=True).to(tl.float32)


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
    """fp32 operands keep full precision in `tl.dot` (TF32 would cost ~1e-3 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def kv_format(cache: torch.Tensor) -> int:
    return FORMAT_CODES.get(cache.dtype, 0)


def kernel_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor) -> tuple:
    """(K, V as the kernels take them, KV_FORMAT, the dtype `tl.dot` multiplies in): a
    quantized cache as bytes, its rows dequantized into the query's dtype."""
    fmt = kv_format(k_cache)
    if fmt == 0:
        return k_cache, v_cache, 0, k_cache.dtype
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), fmt, query.dtype


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
