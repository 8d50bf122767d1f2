"""The decode-rows GEMMs of `cpu_gemm.cpp` over a weight packed once (`pack`): bf16 on AMX
tiles where the CPU has AMX, fp32 on AVX-512 FMA (built by `cpu_build`; `available(dtype)`
says whether one serves). `engine/cpu_linear.py` takes them for up to `TILE_ROWS` rows, oneDNN
for more."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from halfmoon.kernels import cpu_build

# The entry point of each dtype, and the exported check that this build and CPU serve it.
_ENTRY = {torch.bfloat16: ("gemm_bf16", "amx_ready"), torch.float32: ("gemm_fp32", "f32_ready")}
# K a weight's rows must be a multiple of: a bf16 AMX tile holds 32 of K, fp32 packs any K.
_K_MULTIPLE = {torch.bfloat16: 32, torch.float32: 1}


@cache
def available(dtype: torch.dtype) -> bool:
    """Whether the kernel for `dtype` is built (or can be), loads, and runs on this CPU (for
    bf16: the CPU lends this process AMX)."""
    library = _library()
    return dtype in _ENTRY and library is not None and getattr(library, _ENTRY[dtype][1])() == 1


def packable(weight: torch.Tensor) -> bool:
    """A CPU bf16 or fp32 [N, K] weight with N a multiple of 16 (and K of 32 for bf16), whose
    dtype's kernel serves here."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in _ENTRY
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % _K_MULTIPLE[weight.dtype] == 0
        and available(weight.dtype)
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([N, K], `packable`) in its kernel's layout: bf16 as AMX B tiles, [N/16, K/32,
    16 (K pairs), 16 (N), 2]; fp32 as blocks of 16 columns, [N/16, K, 16]."""
    n, k = weight.shape
    weight = weight.detach()
    if weight.dtype == torch.float32:
        return weight.view(n // 16, 16, k).transpose(1, 2).contiguous()
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for a 2-D `x` [M, K] of `packed`'s dtype and `packed` = `pack(W)`."""
    dtype = packed.dtype
    n = packed.shape[0] * 16
    k = packed.shape[1] if dtype == torch.float32 else packed.shape[1] * 32
    if x.dim() != 2 or x.shape[1] != k or x.dtype != dtype or x.device.type != "cpu":
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"cpu_gemm.linear: a CPU {name} [M, {k}] input, not {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=dtype)
    if x.shape[0] == 0:
        return out
    served = getattr(_library(), _ENTRY[dtype][0])(
        x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, torch.get_num_threads(), out.data_ptr()
    )
    if served != 0:
        raise ValueError(f"cpu_gemm.linear: this build or CPU does not serve {dtype}")
    return out


@cache
def _library() -> ctypes.CDLL | None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    gemm = ([ptr, i64, i64, ptr, i64, i32, ptr], i32)
    signatures = {
        "gemm_bf16": gemm,
        "gemm_fp32": gemm,
        "amx_ready": ([], i32),
        "f32_ready": ([], i32),
    }
    return cpu_build.load_functions(Path(__file__).with_name("cpu_gemm.cpp"), signatures)
