"""Prefill attention in Triton: ragged runs of new tokens over a paged prefix, causal within."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.triton_paged import (
    CAUSAL_MASK,
    LOG2_E,
    NO_MASK,
    attend_tiles,
    kernel_inputs,
    softmax_start,
    strides,
)

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _find_query_block(cu_seqlens_ptr, num_seqs, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr):
    """The run (`num_seqs` when past the last) and the query block of it that this program owns."""
    pid = tl.program_id(0)
    runs = tl.arange(0, BLOCK_S)
    run_mask = runs < num_seqs
    starts = tl.load(cu_seqlens_ptr + runs, mask=run_mask, other=0)
    lens = tl.load(cu_seqlens_ptr + runs + 1, mask=run_mask, other=0) - starts
    num_blocks = (lens + BLOCK_M - 1) // BLOCK_M
    seq = tl.sum((tl.cumsum(num_blocks, 0) <= pid).to(tl.int32), 0)
    q_block = pid - tl.sum(tl.where(runs < seq, num_blocks, 0), 0)
    q_start = tl.sum(tl.where(runs == seq, starts, 0), 0)
    q_len = tl.sum(tl.where(runs == seq, lens, 0), 0)
    return seq, q_block, q_start, q_len


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cu_seqlens_ptr,
    block_tables_ptr,
    prefix_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_co,
    stride_ch,
    stride_bt,
    num_seqs,
    num_q_heads,
    block_size,
    group,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    seq, q_block, q_start, q_len = _find_query_block(cu_seqlens_ptr, num_seqs, BLOCK_S, BLOCK_M)
    if seq < num_seqs:
        head = tl.program_id(1)
        kv_head = head // group
        prefix = tl.load(prefix_lens_ptr + seq)
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < head_dim
        io_mask = (rows < q_len)[:, None] & dim_mask[None, :]
        tokens = (q_start + rows).to(tl.int64)
        q_ptrs = q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)
        if KV_FORMAT == 0:  # else the query stays in its dtype, the rows dequantized into it
            q = q.to(k_cache_ptr.dtype.element_ty)
        table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
        query = (q, prefix + rows, dims, dim_mask, scale_log2)
        strides = (stride_cp, stride_co, stride_ch)
        pages = (k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, block_size, strides, head_dim)
        # Keys before this block's first query are visible to every row: no causal mask there.
        visible_end = (prefix + q_block * BLOCK_M) // BLOCK_N * BLOCK_N
        kv_end = prefix + tl.minimum((q_block + 1) * BLOCK_M, q_len)
        state = softmax_start(BLOCK_M, BLOCK_D)
        state = attend_tiles(
            query, state, 0, visible_end, pages, BLOCK_N, NO_MASK, DOT_PRECISION, KV_FORMAT
        )
        acc, _, row_sum = attend_tiles(
            query, state, visible_end, kv_end, pages, BLOCK_N, CAUSAL_MASK, DOT_PRECISION, KV_FORMAT
        )
        out = acc / row_sum[:, None]
        out_ptrs = out_ptr + tokens[:, None] * (num_q_heads * head_dim) + head * head_dim
        tl.store(out_ptrs + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, scale):
    """`reference.prefill_attention`'s contract, in Triton."""
    query, k_cache, v_cache, meta = kernel_inputs(query, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = prefix_lens.shape[0]
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables = block_tables.contiguous()
    # Runs are found on the device; this bounds the query blocks without a host sync.
    grid = (triton.cdiv(num_tokens, BLOCK_M) + num_seqs - 1, num_q_heads)
    tensors = (query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, out)
    sizes = (num_seqs, num_q_heads, k_cache.shape[1], num_q_heads // k_cache.shape[2], head_dim)
    meta |= dict(BLOCK_S=triton.next_power_of_2(num_seqs), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    args = (*tensors, scale * LOG2_E, *strides(query, k_cache, block_tables), *sizes)
    _prefill_kernel[grid](*args, **meta)
    return out
