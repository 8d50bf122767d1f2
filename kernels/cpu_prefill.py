"""The CPU prefill attention of `cpu_prefill.cpp`: bf16 runs over their pages on AMX tiles.

Serves bf16 caches of head size 64 in pages of a multiple of 16 tokens on CPUs with AMX (built
by `cpu_build`; `supports` says whether it serves given tensors). The torch reference serves
the rest.
"""

from __future__ import annotations

import ctypes

import torch

from halfmoon.kernels import cpu_build

HEAD_DIM = 64


def available() -> bool:
    """Whether the kernel is built (or can be), loads, and the CPU lends this process AMX."""
    return LIBRARY.ready("amx_ready")


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel serves these tensors: CPU bf16, head size 64, contiguous caches
    of pages of a multiple of 16 tokens, whole query groups."""
    return (
        query.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        and query.shape[-1] == HEAD_DIM
        and k_cache.shape[1] % 16 == 0
        and query.shape[1] % k_cache.shape[2] == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and available()
    )


def prefill_attention(query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, scale):
    """`reference.prefill_attention`'s contract, for tensors `supports` accepts."""
    if not all(t.device.type == "cpu" for t in (cu_seqlens_q, block_tables, prefix_lens)):
        raise ValueError("the CPU prefill attention reads CPU tensors only")  # not a segfault
    query = query.contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    prefixes = prefix_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_runs = prefixes.shape[0]
    if num_runs == 0 or query.shape[0] == 0:
        return out
    _, block_size, kv_heads, head_dim = k_cache.shape
    inputs = cpu_build.pointers(query, k_cache, v_cache, cu, tables, prefixes)
    sizes = (num_runs, query.shape[1], kv_heads, head_dim, block_size, tables.shape[1])
    run = (scale, torch.get_num_threads())
    served = LIBRARY.get().prefill_attention_bf16(*inputs, *sizes, *run, out.data_ptr())
    if served != 0:
        raise ValueError(f"the CPU prefill attention does not serve {tuple(k_cache.shape)}")
    return out


_i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
LIBRARY = cpu_build.Library(
    "cpu_prefill.cpp",
    {
        "prefill_attention_bf16": ([_ptr] * 6 + [_i64] * 6 + [ctypes.c_float, _i32, _ptr], _i32),
        "amx_ready": ([], _i32),
    },
)
