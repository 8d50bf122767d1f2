"""Triton kernels that move KV rows and pages: `store_kv`, `gather_pages`, `scatter_pages`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.kv_quant import QMAX
from halfmoon.kernels.triton_paged import kv_format

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
    qmax,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FORMAT: tl.constexpr,
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
        head_rows = page * stride_cp + offset * stride_co + tl.arange(0, BLOCK_H) * stride_ch
        row = token.to(tl.int64)
        key = tl.load(key_ptr + row * stride_kn + heads * stride_kh + dims, mask=mask, other=0.0)
        value = tl.load(
            value_ptr + row * stride_vn + heads * stride_vh + dims, mask=mask, other=0.0
        )
        head_mask = tl.arange(0, BLOCK_H) < num_heads
        store_rows(k_cache_ptr, head_rows, dims, mask, head_mask, key, head_dim, qmax, KV_FORMAT)
        store_rows(v_cache_ptr, head_rows, dims, mask, head_mask, value, head_dim, qmax, KV_FORMAT)


@triton.jit
def store_rows(cache_ptr, head_rows, dims, mask, head_mask, rows, head_dim, qmax, KV_FORMAT):
    """One token's rows of every head (`head_rows`: each one's offset) into a cache: as they
    are, or quantized (kv_quant.py): each row over its largest magnitude / `qmax` (an fp16
    scale, stored in the 2 bytes after its values) into 8-bit codes of the cache's bytes."""
    offsets = head_rows[:, None] + dims[None, :]
    if KV_FORMAT == 0:
        tl.store(cache_ptr + offsets, rows.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        x = rows.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        # IEEE divisions (div_rn), as torch divides: a CUDA `/` may be 2 ulp off, and a code
        # or scale one step off the reference's.
        scale = tl.div_rn(amax, qmax).to(tl.float16)  # rounded up where it rounded down
        bits = scale.to(tl.uint16, bitcast=True)
        bits = tl.where(scale.to(tl.float32) * qmax < amax, bits + 1, bits)
        scale = tl.where(bits > 0, bits.to(tl.float16, bitcast=True), 1.0).to(tl.float16)
        scaled = x * tl.div_rn(1.0, scale.to(tl.float32))[:, None]
        scaled = tl.minimum(tl.maximum(scaled, -qmax), qmax)
        tl.store(cache_ptr + offsets, quantize(scaled, KV_FORMAT), mask=mask)
        bits = scale.to(tl.uint16, bitcast=True)
        tl.store(cache_ptr + head_rows + head_dim, (bits & 0xFF).to(tl.uint8), mask=head_mask)
        tl.store(cache_ptr + head_rows + head_dim + 1, (bits >> 8).to(tl.uint8), mask=head_mask)


@triton.jit
def quantize(x, KV_FORMAT: tl.constexpr):
    """fp32 values within the format's range as its 8-bit codes (uint8), rounded to nearest
    even as torch rounds: int8 by adding and taking away 1.5 * 2^23; fp8 on the fp32's bits
    (its exponent rebiased, the mantissa's low bits rounded off), or below the format's
    smallest normal as a whole number of its subnormal steps. (Through an fp16 would round
    twice: 1 value in ~2^7 one step off.)"""
    if KV_FORMAT == 1:
        whole = (x + 12582912.0) - 12582912.0
        return whole.to(tl.int8).to(tl.uint8, bitcast=True)
    bits = x.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    if KV_FORMAT == 2:  # e4m3: bias 7, 3 mantissa bits, smallest normal 2^-6, steps of 2^-9
        rebased = magnitude - 0x3C000000
        normal = (rebased + 0x7FFFF + ((rebased >> 20) & 1)) >> 20
        steps = tl.abs(x) * 512.0
        small = tl.abs(x) < 0.015625
    else:  # e5m2: bias 15, 2 mantissa bits, smallest normal 2^-14, steps of 2^-16
        rebased = magnitude - 0x38000000
        normal = (rebased + 0xFFFFF + ((rebased >> 21) & 1)) >> 21
        steps = tl.abs(x) * 65536.0
        small = tl.abs(x) < 0.00006103515625
    subnormal = ((steps + 12582912.0) - 12582912.0).to(tl.uint32)
    code = tl.where(small, subnormal, normal)
    return (((bits >> 24) & 0x80) | code).to(tl.uint8)


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


def store_kv(key, value, k_cache, v_cache, slot_mapping):
    """`reference.store_kv`'s contract, in Triton."""
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
    fmt = kv_format(k_cache)
    qmax = QMAX.get(k_cache.dtype, 0.0)
    if fmt:  # written as bytes: codes and scales
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
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
        qmax,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FORMAT=fmt,
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
