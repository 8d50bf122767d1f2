"""Paged decode attention in Triton: split-K over the context, then one reduction pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.decode_splits import BLOCK_N, SplitPlan, plan_splits
from halfmoon.kernels.triton_paged import (
    END_MASK,
    LOG2_E,
    attend_tiles,
    kernel_inputs,
    softmax_start,
    strides,
)

__all__ = ["SplitPlan", "paged_decode_attention", "plan_splits"]


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_cp,
    stride_co,
    stride_ch,
    stride_bt,
    block_size,
    num_q_heads,
    group,
    head_dim,
    tokens_per_split,
    num_splits,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    heads = kv_head * group + groups
    head_mask = (groups < group)[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask,
        other=0.0,
    )
    if KV_FORMAT == 0:  # else the query stays in its dtype, the rows dequantized into it
        q = q.to(k_cache_ptr.dtype.element_ty)
    query = (q, None, dims, dim_mask, scale_log2)
    table_row_ptr = block_tables_ptr + seq * stride_bt
    strides = (stride_cp, stride_co, stride_ch)
    pages = (k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, block_size, strides, head_dim)
    state = softmax_start(BLOCK_G, BLOCK_D)
    acc, row_max, row_sum = attend_tiles(
        query, state, start, end, pages, BLOCK_N, END_MASK, DOT_PRECISION, KV_FORMAT
    )
    # A split past the end of a short sequence saw no tokens; the reduction skips it.
    safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / safe_sum[:, None]
    if SINGLE_SPLIT:
        out_ptrs = out_ptr + (seq * num_q_heads + heads[:, None]) * head_dim + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        part = (seq * num_q_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], out, mask=head_mask)
        tl.store(
            part_lse_ptr + part,
            tl.where(row_sum > 0, row_max + tl.log2(safe_sum), float("-inf")),
            mask=groups < group,
        )


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    num_q_heads,
    head_dim,
    tokens_per_split,
    num_splits,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < tl.cdiv(seq_len, tokens_per_split)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    part = (seq * num_q_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + part[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0)
    out_ptrs = out_ptr + (seq * num_q_heads + head) * head_dim + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """`reference.paged_decode_attention`'s contract, in Triton."""
    query, k_cache, v_cache, meta = kernel_inputs(query, k_cache, v_cache)
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if block_tables.stride(1) != 1:  # a graph's narrower view of its tables keeps row strides
        block_tables = block_tables.contiguous()
    # The block table's width bounds every context without reading seq_lens on the host.
    plan = plan_splits(block_tables.shape[1] * block_size)
    single = plan.num_splits == 1
    part_shape = (num_seqs, num_q_heads, plan.num_splits) if not single else (1,)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=query.device)
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse)
    splits = (plan.tokens_per_split, plan.num_splits)
    sizes = (block_size, num_q_heads, group, head_dim, *splits)
    meta |= dict(
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, SINGLE_SPLIT=single
    )
    args = (*tensors, scale * LOG2_E, *strides(query, k_cache, block_tables), *sizes)
    _decode_split_kernel[(num_seqs, num_kv_heads, plan.num_splits)](*args, **meta)
    if not single:
        parts = (part_out, part_lse, seq_lens, out)
        block_splits = triton.next_power_of_2(plan.num_splits)
        reduce_meta = dict(BLOCK_SPLITS=block_splits, BLOCK_D=meta["BLOCK_D"])
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            *parts, num_q_heads, head_dim, *splits, **reduce_meta
        )
    return out
