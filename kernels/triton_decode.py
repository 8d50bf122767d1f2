"""Paged decode attention in Triton: split-K over the context, then one reduction pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.decode_splits import BLOCK_N, SplitPlan, plan_splits
from halfmoon.kernels.triton_paged import (
    LOG2_E,
    attend_tiles,
    check_cache,
    dot_precision,
    head_dim_block,
    kernel_caches,
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
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, row_max, row_sum = attend_tiles(
        q,
        acc,
        row_max,
        row_sum,
        start,
        end,
        None,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq * stride_bt,
        dims,
        dim_mask,
        kv_head,
        block_size,
        stride_cp,
        stride_co,
        stride_ch,
        scale_log2,
        head_dim,
        BLOCK_N,
        APPLY_MASK=True,
        CAUSAL=False,
        DOT_PRECISION=DOT_PRECISION,
        KV_FORMAT=KV_FORMAT,
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


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence ([S, q_heads, D]) over its first `seq_lens[s]` cached tokens."""
    check_cache(k_cache, v_cache, query)
    if query.stride(2) != 1:
        query = query.contiguous()
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
    block_d = head_dim_block(head_dim)
    k_cache, v_cache, fmt, dot_dtype = kernel_caches(k_cache, v_cache, query)
    tensors = (query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse)
    splits = (plan.tokens_per_split, plan.num_splits)
    sizes = (block_size, num_q_heads, group, head_dim, *splits)
    meta = dict(BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=BLOCK_N)
    meta |= dict(SINGLE_SPLIT=single, DOT_PRECISION=dot_precision(dot_dtype), KV_FORMAT=fmt)
    args = (*tensors, scale * LOG2_E, *strides(query, k_cache, block_tables), *sizes)
    _decode_split_kernel[(num_seqs, num_kv_heads, plan.num_splits)](*args, **meta)
    if not single:
        parts = (part_out, part_lse, seq_lens, out)
        block_splits = triton.next_power_of_2(plan.num_splits)
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            *parts, num_q_heads, head_dim, *splits, BLOCK_SPLITS=block_splits, BLOCK_D=block_d
        )
    return out
