"""The CPU decode attention of `cpu_attention.cpp`: pages read in place, K and V once each.

Issue 31 measured the torch reference (a page gather, then SDPA over it) at about half of a
bf16 decode step; this kernel reads each cached token once for all query heads of its KV head
(built by `cpu_build`; `available()` says whether it loaded).
"""

from __future__ import annotations

import ctypes

import torch

from halfmoon.kernels import cpu_build
from halfmoon.kernels.kv_quant import FORMAT_CODES, head_dim_of

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KV_FORMATS = FORMAT_CODES  # a quantized cache's format code; 0: in the query's dtype


def available() -> bool:
    """Whether the kernel is built (or can be) and loads on this machine."""
    return LIBRARY.get() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel serves these tensors: CPU, one dtype it knows (or caches quantized
    in a format it knows, with their scales), contiguous caches."""
    kv_dtype = query.dtype if k_cache.dtype in DTYPES else k_cache.dtype
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and k_cache.dtype == v_cache.dtype == kv_dtype
        and (kv_dtype == query.dtype or kv_dtype in KV_FORMATS)
        and head_dim_of(k_cache) == query.shape[-1]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and available()
    )


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """`reference.paged_decode_attention`'s contract: one query per sequence ([S, q_heads, D])
    over its first `seq_lens[s]` (>= 1) cached tokens, read in place."""
    num_seqs, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not all(t.device.type == "cpu" for t in (query, k_cache, v_cache, block_tables, seq_lens)):
        raise ValueError("the CPU decode attention reads CPU tensors only")  # not a segfault
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    inputs = cpu_build.pointers(query, k_cache, v_cache, tables, lens)
    sizes = (num_seqs, q_heads, kv_heads, head_dim, block_size, tables.shape[1])
    kv_format = KV_FORMATS.get(k_cache.dtype, 0)
    run = (scale, DTYPES[query.dtype], kv_format, k_cache.shape[-1], torch.get_num_threads())
    LIBRARY.get().paged_decode_attention(*inputs, *sizes, *run, out.data_ptr())
    return out


_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
LIBRARY = cpu_build.Library(
    "cpu_attention.cpp",
    {
        "paged_decode_attention": (
            [_ptr] * 5 + [_i64] * 6 + [ctypes.c_float, _i32, _i32, _i64, _i32, _ptr],
            None,
        )
    },
)
