"""The decode-rows GEMM of `cpu_gemm.cpp`: bf16 linear layers on AMX tiles over a weight
packed once (`pack`), for CPUs with AMX (built by `cpu_build`; `available()` says whether it
serves). `engine/cpu_linear.py` takes it for up to `DECODE_ROWS` rows, oneDNN for more."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from halfmoon.kernels import cpu_build


@cache
def available() -> bool:
    """Whether the kernel is built (or can be), loads, and the CPU lends this process AMX."""
    library = _library()
    return library is not None and library.amx_ready() == 1


def packable(weight: torch.Tensor) -> bool:
    """A CPU bf16 [N, K] weight of whole tiles (N a multiple of 16, K of 32), where AMX serves."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
        and available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([N, K], `packable`) as AMX B tiles: [N/16, K/32, 16 (K pairs), 16 (N), 2]."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for a 2-D bf16 `x` [M, K] and `packed` = `pack(W)`."""
    blocks, steps = packed.shape[:2]
    n, k = blocks * 16, steps * 32
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"cpu_gemm.linear: a CPU bf16 [M, {k}] input, not {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if x.shape[0] == 0:
        return out
    served = _library().gemm_bf16(
        x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, torch.get_num_threads(), out.data_ptr()
    )
    if served != 0:
        raise ValueError("cpu_gemm.linear: this build or CPU does not serve AMX")
    return out


@cache
def _library() -> ctypes.CDLL | None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "gemm_bf16": ([ptr, i64, i64, ptr, i64, i32, ptr], i32),
        "amx_ready": ([], i32),
    }
    return cpu_build.load_functions(Path(__file__).with_name("cpu_gemm.cpp"), signatures)
