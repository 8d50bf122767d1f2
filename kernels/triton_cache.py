"""Triton kernels that move KV rows and pages: `store_kv`, `gather_pages`, `scatter_pages`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 1024


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cp,
    stride_co,
    stride_ch,
    block_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    # A negative slot (padding) writes nothing.
    if slot >= 0:
        page = slot // block_size
        offset = slot % block_size
        cache_offsets = page * stride_cp + offset * stride_co + heads * stride_ch + dims
        row = token.to(tl.int64)
        key = tl.load(key_ptr + row * stride_kn + heads * stride_kh + dims, mask=mask)
        value = tl.load(value_ptr + row * stride_vn + heads * stride_vh + dims, mask=mask)
        tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_pages_kernel(
    src_ptr,
    dst_ptr,
    page_ids_ptr,
    dst_page_stride,
    page_numel,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0)
    page = tl.load(page_ids_ptr + index).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < page_numel
    data = tl.load(src_ptr + index.to(tl.int64) * page_numel + offsets, mask=mask)
    tl.store(
        dst_ptr + page * dst_page_stride + offsets, data.to(dst_ptr.dtype.element_ty), mask=mask
    )


def _check_rows_contiguous(cache: torch.Tensor) -> None:
    """Pages may be strided (a slice of a bigger pool) but each page must be one dense block."""
    if not cache[0].is_contiguous():
        raise ValueError(
            f"KV cache strides {tuple(cache.stride())} are not dense within a page; "
            "pass a cache laid out as [num_pages, block_size, num_kv_heads, head_dim]"
        )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write rows `key[i]`, `value[i]` ([N, kv_heads, D]) to slot `slot_mapping[i]`; -1 skips."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    _check_rows_contiguous(k_cache)
    _check_rows_contiguous(v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"K and V caches differ in strides: {k_cache.stride()} vs {v_cache.stride()}"
        )
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pack the listed pages of one layer's cache into a contiguous `[n, bs, H, D]` buffer.
    torch's `index_select` does it: a Triton kernel for this plain row copy measured 0.59x
    torch on the H100 (issue 13), its launch costing more than the copy at these sizes."""
    _check_rows_contiguous(cache)
    return torch.index_select(cache, 0, page_ids)


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Unpack a buffer made by `gather_pages` into the listed pages of one layer's cache
    (ahead of torch's indexed assignment on the H100)."""
    _check_rows_contiguous(cache)
    if page_ids.numel() == 0:
        return
    page_numel = cache[0].numel()
    grid = (page_ids.numel(), triton.cdiv(page_numel, COPY_BLOCK))
    _scatter_pages_kernel[grid](
        buffer.contiguous(), cache, page_ids, cache.stride(0), page_numel, BLOCK=COPY_BLOCK
    )
