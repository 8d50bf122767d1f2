"""Shared pieces of the paged attention kernels: a run of KV tiles folded into an online softmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.kv_quant import FORMAT_CODES

LOG2_E = 1.4426950408889634


# What `attend_tiles` hides: nothing, the keys past the range's end, or also those after each
# query row's own position.
NO_MASK = tl.constexpr(0)
END_MASK = tl.constexpr(1)
CAUSAL_MASK = tl.constexpr(2)


@triton.jit
def softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The running (acc, row max, row sum) of `ROWS` query rows before any key."""
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    return acc, tl.full([ROWS], float("-inf"), dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32)


@triton.jit
def attend_tiles(
    query,
    state,
    start,
    end,
    pages,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """Fold the keys in [start, end), found page by page via a block table row, into the running
    softmax `state` (`softmax_start`); `MASK` says which keys to hide (`NO_MASK`, ...).
    `query`: (q, each row's position, its head lanes `dims`, their mask, the scale in base 2);
    `pages`: (K cache, V cache, the block table row, KV head, block size, the strides of a
    page's page, offset and head, head dim). `KV_FORMAT` (`kv_format`): 0 the caches hold
    values; else 8-bit rows with their scales, the caches given as bytes (kv_quant.py),
    dequantized here into q's dtype."""
    q, positions, dims, dim_mask, scale_log2 = query
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, block_size, strides, head_dim = pages
    stride_cp, stride_co, stride_ch = strides
    acc, row_max, row_sum = state
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
        if MASK == CAUSAL_MASK:
            allowed = allowed & (tokens[None, :] <= positions[:, None])
        acc, row_max, row_sum = online_softmax_step(
            q, key, value, acc, row_max, row_sum, allowed, scale_log2, MASK, DOT_PRECISION
        )
    return acc, row_max, row_sum


@triton.jit
def load_tile(cache_ptr, rows, dims, token_mask, dim_mask, head_dim, KV_FORMAT: tl.constexpr):
    """A tile of K or V rows (`rows`: each one's offset) as values; a quantized cache's rows
    dequantized into fp32, each by its fp16 scale (the 2 bytes after its values)."""
    mask = token_mask[:, None] & dim_mask[None, :]
    raw = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0)
    # One return after a constexpr if/else: compiled Triton visits the statements after an
    # early return too, and refuses the two paths' different return types (the cache's dtype,
    # fp32).
    if KV_FORMAT == 0:
        tile = raw
    else:
        low = tl.load(cache_ptr + rows + head_dim, mask=token_mask, other=0).to(tl.uint16)
        high = tl.load(cache_ptr + rows + head_dim + 1, mask=token_mask, other=0).to(tl.uint16)
        scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        tile = dequantize(raw, KV_FORMAT) * scale[:, None]
    return tile


@triton.jit
def dequantize(raw, KV_FORMAT: tl.constexpr):
    """8-bit codes (uint8) as fp32: int8 values, or an fp8 byte placed in an fp16's bits (e5m2
    is an fp16's top byte; e4m3's exponent and mantissa sit 7 bits up, reading 2^8 too small)."""
    if KV_FORMAT == 1:
        values = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif KV_FORMAT == 2:
        wide = raw.to(tl.uint16)
        bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        values = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        values = (raw.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    return values


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
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one KV tile into the running (acc, row max, row sum) of flash attention, in base 2."""
    scores = tl.dot(q, tl.trans(key), input_precision=DOT_PRECISION) * scale_log2
    if MASK != NO_MASK:
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


def kernel_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """(query, K, V as the paged kernels take them, and their BLOCK_D, DOT_PRECISION and
    KV_FORMAT): a quantized cache as bytes, its rows dequantized into the query's dtype."""
    check_cache(k_cache, v_cache, query)
    if query.stride(2) != 1:
        query = query.contiguous()
    fmt = kv_format(k_cache)
    dot_dtype = k_cache.dtype if fmt == 0 else query.dtype
    if fmt != 0:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    meta = dict(BLOCK_D=head_dim_block(query.shape[2]), DOT_PRECISION=dot_precision(dot_dtype))
    return query, k_cache, v_cache, meta | dict(KV_FORMAT=fmt)


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
