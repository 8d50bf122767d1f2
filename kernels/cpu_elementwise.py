"""The per-token CPU kernels of `cpu_elementwise.cpp`: RMSNorm with its residual add, rotary
embedding, SwiGLU and the KV write, each one pass where the torch references take 4-8 ops.

Each takes its reference's arguments and falls back to it for a layout or dtype the kernel
does not cover (a tensor not dense where the kernel needs it, a dtype other than fp32 or bf16).
The KV write into an 8-bit cache (kv_quant.py) quantizes each row as the reference does, bit
for bit (`cpu_quant.h`).
"""

from __future__ import annotations

import ctypes

import torch

from halfmoon.kernels import cpu_build, reference
from halfmoon.kernels.cpu_attention import KV_FORMATS
from halfmoon.kernels.cpu_build import pointers
from halfmoon.kernels.kv_quant import is_quantized

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    """Whether the kernels are built (or can be) and load on this machine."""
    return LIBRARY.get() is not None


def rms_norm(x, weight, eps: float, residual=None):
    """`reference.rms_norm`: RMSNorm of `x + residual`; returns (normed, the new residual)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not _dense(*tensors) or x.shape[-1] != weight.numel():
        return reference.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    inputs, outputs = pointers(x, residual, weight), pointers(out, summed)
    LIBRARY.get().rms_norm(*inputs, eps, rows, width, *_dtype_and_threads(x), *outputs)
    return out, x if summed is None else summed


def rotary_embedding(positions, query, key, cos_sin_cache) -> None:
    """`reference.rotary_embedding`: rotates `query` and `key` ([N, heads, D]) in place."""
    head_dim = query.shape[-1]
    dense = _heads_dense(query) and _heads_dense(key) and _fits_cache(cos_sin_cache, head_dim)
    dense = dense and _on_cpu(positions)
    positions = positions.to(torch.int64).contiguous()
    if not (dense and _one_dtype(query, key)):
        reference.rotary_embedding(positions, query, key, cos_sin_cache)
        return
    tables, kernel = pointers(positions, cos_sin_cache), LIBRARY.get().rotary_embedding
    for x in (query, key):
        layout = (x.stride(0), x.shape[1], head_dim)  # a token's stride, its heads, head size
        kernel(x.data_ptr(), *layout, *tables, x.shape[0], *_dtype_and_threads(x))


def silu_and_mul(x):
    """`reference.silu_and_mul`: SiLU of the first half of the last dimension times the second."""
    if not _dense(x):
        return reference.silu_and_mul(x)
    width = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], width, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    LIBRARY.get().silu_and_mul(x.data_ptr(), rows, width, *_dtype_and_threads(x), out.data_ptr())
    return out


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """`reference.store_kv`: row `key[i]`, `value[i]` to slot `slot_mapping[i]`; -1 skips."""
    if is_quantized(k_cache):
        _store_quantized(key, value, k_cache, v_cache, slot_mapping)
        return
    dense = _heads_dense(key) and _heads_dense(value) and _dense(k_cache, v_cache)
    if not (dense and _on_cpu(slot_mapping) and _one_dtype(key, value, k_cache, v_cache)):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    strides = (key.stride(0), value.stride(0))
    rows = (key.shape[0], key.shape[1] * key.shape[2])  # tokens, and each one's heads x head size
    inputs, caches = pointers(key, value), pointers(k_cache, v_cache)
    kernel = LIBRARY.get().store_kv
    kernel(*inputs, *strides, slots.data_ptr(), *rows, *_dtype_and_threads(key), *caches)


def _store_quantized(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The KV write into a quantized cache: each row quantized as `kv_quant.quantize` does,
    bit for bit, in one pass."""
    rows_ok = _heads_dense(key) and _heads_dense(value) and _one_dtype(key, value)
    caches_ok = (
        k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    )
    if not (rows_ok and caches_ok and _on_cpu(k_cache, v_cache, slot_mapping)):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    strides = (key.stride(0), value.stride(0))
    sizes = (key.shape[0], key.shape[1], key.shape[2])  # tokens, heads, head size
    kv_format = KV_FORMATS[k_cache.dtype]
    run = (DTYPES[key.dtype], kv_format, torch.get_num_threads())
    inputs, caches = pointers(key, value), pointers(k_cache, v_cache)
    LIBRARY.get().store_kv_quantized(*inputs, *strides, slots.data_ptr(), *sizes, *run, *caches)


def _dtype_and_threads(x: torch.Tensor) -> tuple[int, int]:
    """What every kernel here takes after its sizes: the dtype's code and the OpenMP team."""
    return DTYPES[x.dtype], torch.get_num_threads()


def _one_dtype(*tensors: torch.Tensor) -> bool:
    """All of `tensors` in one dtype the kernels know."""
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        return False
    return all(t.dtype == dtype for t in tensors)


def _dense(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype the kernels know, each contiguous."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return False
    return _one_dtype(*tensors)


def _heads_dense(x: torch.Tensor) -> bool:
    """CPU [N, heads, D] with each token's heads one dense row (tokens any stride apart)."""
    return (
        x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    )


def _on_cpu(*tensors: torch.Tensor) -> bool:
    """Every one of `tensors` in host memory: the kernels read each through its pointer."""
    return all(t.device.type == "cpu" for t in tensors)


def _fits_cache(cos_sin_cache: torch.Tensor, head_dim: int) -> bool:
    return (
        _on_cpu(cos_sin_cache)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == head_dim
        and head_dim % 2 == 0
    )


_i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
LIBRARY = cpu_build.Library(
    "cpu_elementwise.cpp",
    {
        "rms_norm": ([_ptr, _ptr, _ptr, ctypes.c_float, _i64, _i64, _i32, _i32, _ptr, _ptr], None),
        "rotary_embedding": ([_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32, _i32], None),
        "silu_and_mul": ([_ptr, _i64, _i64, _i32, _i32, _ptr], None),
        "store_kv": ([_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i32, _i32, _ptr, _ptr], None),
        "store_kv_quantized": (
            [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i32, _i32, _i32, _ptr, _ptr],
            None,
        ),
    },
)
