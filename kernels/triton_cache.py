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
def _copy_pages_kernel(
    src_ptr,
    dst_ptr,
    page_ids_ptr,
    src_page_stride,
    dst_page_stride,
    page_numel,
    PAGES_IN_SRC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0)
    page = tl.load(page_ids_ptr + index).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < page_numel
    src_row = page if PAGES_IN_SRC else index.to(tl.int64)
    dst_row = index.to(tl.int64) if PAGES_IN_SRC else page
    data = tl.load(src_ptr + src_row * src_page_stride + offsets, mask=mask)
    tl.store(
        dst_ptr + dst_row * dst_page_stride + offsets, data.to(dst_ptr.dtype.element_ty), mask=mask
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


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, into: bool) -> None:
    page_numel = dst[0].numel()
    grid = (page_ids.numel(), triton.cdiv(page_numel, COPY_BLOCK))
    _copy_pages_kernel[grid](
        src,
        dst,
        page_ids,
        src.stride(0),
        dst.stride(0),
        page_numel,
        PAGES_IN_SRC=not into,
        BLOCK=COPY_BLOCK,
    )


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Pack the listed pages of one layer's cache into a contiguous `[n, bs, H, D]` buffer."""
    _check_rows_contiguous(cache)
    buffer = torch.empty(
        (page_ids.numel(), *cache.shape[1:]), dtype=cache.dtype, device=cache.device
    )
    if page_ids.numel() > 0:
        _copy_pages(cache, buffer, page_ids, into=False)
    return buffer


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Unpack a buffer made by `gather_pages` into the listed pages of one layer's cache."""
    _check_rows_contiguous(cache)
    if page_ids.numel() > 0:
        _copy_pages(buffer.contiguous(), cache, page_ids, into=True)
