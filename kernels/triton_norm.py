"""Triton kernels for the per-token layers around attention: `rms_norm` and `rotary_embedding`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        # Round the sum to the residual dtype first, as the reference does.
        summed = (x + residual.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(new_residual_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * hidden + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(x, weight, eps, residual=None):
    """`reference.rms_norm`'s contract, in Triton."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden).contiguous()
    if residual is None:
        new_residual = x
        residual_rows = rows
    else:
        residual_rows = residual.reshape(-1, hidden).contiguous()
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        new_residual = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    out_dtype = torch.promote_types(weight.dtype, new_residual.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            new_residual,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out, new_residual


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_n,
    stride_h,
    token,
    num_heads,
    cos,
    sin,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    first_ptrs = x_ptr + token * stride_n + heads * stride_h + dims
    first = tl.load(first_ptrs, mask=mask).to(tl.float32)
    second = tl.load(first_ptrs + half, mask=mask).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(first_ptrs, (first * cos - second * sin).to(dtype), mask=mask)
    tl.store(first_ptrs + half, (second * cos + first * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row_ptr = cache_ptr + position * stride_cache + dims
    cos = tl.load(row_ptr, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(row_ptr + half, mask=dims < half, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, stride_qn, stride_qh, token, num_q_heads, cos, sin, half, BLOCK_QH, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, stride_kn, stride_kh, token, num_k_heads, cos, sin, half, BLOCK_KH, BLOCK_HALF
    )


def rotary_embedding(positions, query, key, cos_sin_cache):
    """`reference.rotary_embedding`'s contract, in Triton."""
    num_tokens, num_q_heads, head_dim = query.shape
    if query.stride(2) != 1 or key.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding needs the head dimension of query, key and cache dense")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        key.shape[1],
        half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(key.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
