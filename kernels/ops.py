"""The one dispatch point of the attention and per-token kernels (the linear layers' GEMMs
are `engine/cpu_linear.py`'s choice: oneDNN, MKL, or `cpu_gemm` on AMX tiles).

CUDA tensors run the Triton kernels; CPU tensors the compiled C++ kernels of `cpu_attention`
(decode attention), `cpu_prefill` (bf16 prefill attention on AMX) and `cpu_elementwise`
(RMSNorm, rotary, SwiGLU, the KV write) where they build (`cpu_build`), and the torch
references for the rest.
`HALFMOON_KERNELS=torch|triton` forces one backend (`torch`: the references alone; tests run
Triton on CPU with `TRITON_INTERPRET=1`).

Prefill runs with no cached prefix attend over the step's own K/V with torch's fused
attention (`causal_attention`; FlashAttention on CUDA), which measured faster than the paged
Triton kernel on an H100 (issue 13); runs over a cached prefix read it from the pages. Where
`cpu_prefill` serves, every run reads the pages: it is 2-3x faster than torch's SDPA there.
`HALFMOON_PREFILL_ATTENTION=paged` sends every run through the paged kernel.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from halfmoon.kernels import cpu_attention, cpu_elementwise, cpu_prefill, reference
from halfmoon.kernels.kv_quant import as_bytes, is_quantized

BACKEND_ENV = "HALFMOON_KERNELS"
PREFILL_ENV = "HALFMOON_PREFILL_ATTENTION"


def backend_for(tensor: torch.Tensor) -> ModuleType:
    """The module whose kernels serve `tensor`'s device (or the one forced by the environment)."""
    forced = os.environ.get(BACKEND_ENV, "auto")
    if forced == "torch" or (forced == "auto" and tensor.device.type != "cuda"):
        return reference
    if forced not in ("auto", "triton"):
        raise ValueError(f"{BACKEND_ENV}={forced!r}: expected 'auto', 'torch' or 'triton'")
    from halfmoon.kernels import triton_kernels

    return triton_kernels


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    _per_token(key, value, k_cache, v_cache, slot_mapping).store_kv(
        key, value, k_cache, v_cache, slot_mapping
    )


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    native = _native_cpu(query, k_cache, v_cache, block_tables, seq_lens)
    if native and cpu_attention.supports(query, k_cache, v_cache):
        backend = cpu_attention
    else:
        backend = backend_for(query)
    return backend.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)


def _per_token(*tensors: torch.Tensor | None) -> ModuleType:
    """Where RMSNorm, rotary, SwiGLU and the KV write run: Triton on CUDA, the compiled
    `cpu_elementwise` on CPU (when it builds), the torch references when forced or else."""
    if _native_cpu(*tensors) and cpu_elementwise.available():
        return cpu_elementwise
    return backend_for(tensors[0])


def _native_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether `tensors` may take the compiled C++ kernels: every one (None: absent) on the
    CPU, since the kernels read each through its pointer (one on a GPU would crash the
    process), unless `HALFMOON_KERNELS` asks for the references alone (or names another
    backend). Checked on every call, before `backend_for`, being the common case on CPU."""
    if os.environ.get(BACKEND_ENV, "auto") != "auto":
        return False
    return all(t is None or t.device.type == "cpu" for t in tensors)


def prefill_attention(query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, scale):
    backend = cpu_prefill if native_prefill(query, k_cache, v_cache) else backend_for(query)
    return backend.prefill_attention(
        query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, scale
    )


def native_prefill(query, k_cache, v_cache) -> bool:
    """Whether `cpu_prefill` serves these tensors; then runs without a cached prefix read the
    pages too rather than take `causal_attention`."""
    return _native_cpu(query, k_cache, v_cache) and cpu_prefill.supports(query, k_cache, v_cache)


def dense_prefill() -> bool:
    """Whether prefill runs without a cached prefix take `causal_attention` (the default)."""
    policy = os.environ.get(PREFILL_ENV, "auto")
    if policy not in ("auto", "paged"):
        raise ValueError(f"{PREFILL_ENV}={policy!r}: expected 'auto' or 'paged'")
    return policy == "auto"


def causal_attention(query, key, value, run_lens, scale):
    """Ragged runs of `run_lens` tokens, each causal over itself only (no cached prefix)."""
    return reference.causal_attention(query, key, value, run_lens, scale)


def gather_pages(cache, page_ids):
    # A quantized cache's pages move as bytes (kv_quant.py): values and scales alike.
    return backend_for(cache).gather_pages(as_bytes(cache), page_ids).view(cache.dtype)


def scatter_pages(cache, page_ids, buffer) -> None:
    if is_quantized(cache):
        cache, buffer = as_bytes(cache), as_bytes(buffer.to(cache.dtype))
    backend_for(cache).scatter_pages(cache, page_ids, buffer)


def rms_norm(x, weight, eps, residual=None):
    return _per_token(x, weight, residual).rms_norm(x, weight, eps, residual)


def silu_and_mul(x):
    backend = _per_token(x)
    return (backend if backend is cpu_elementwise else reference).silu_and_mul(x)


def rotary_embedding(positions, query, key, cos_sin_cache) -> None:
    backend = _per_token(query, key, positions, cos_sin_cache)
    backend.rotary_embedding(positions, query, key, cos_sin_cache)
