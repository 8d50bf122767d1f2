"""The decode-rows GEMMs of `cpu_gemm.cpp` over a weight packed once (`pack`): bf16 on AMX
tiles where the CPU has AMX, and on vectors (AVX-512 or AVX2 FMA) fp32 and bf16 (the bf16
weight widened to fp32 sums as it is loaded). Built by `cpu_build`; `kind(dtype)` says which
serves a dtype here. `engine/cpu_linear.py` decides for which row counts they serve.
"""

from __future__ import annotations

import ctypes

import torch

from halfmoon.kernels import cpu_build

AMX, BLOCKS = "amx", "blocks"  # the two layouts (and kernels) a weight is packed for


def kind(dtype: torch.dtype) -> str | None:
    """The kernel that serves `dtype` with this build and CPU: `amx` (bf16 on AMX tiles),
    `blocks` (vectors, fp32 or bf16), or None."""
    if dtype == torch.bfloat16 and LIBRARY.ready("amx_ready"):
        return AMX
    if dtype in (torch.bfloat16, torch.float32) and LIBRARY.ready("vec_ready"):
        return BLOCKS
    return None


def available(dtype: torch.dtype) -> bool:
    """Whether a kernel serves `dtype` here (`kind` is not None)."""
    return kind(dtype) is not None


def packable(weight: torch.Tensor) -> bool:
    """A CPU bf16 or fp32 [N, K] weight with N a multiple of 16 (and K of 32 for AMX), whose
    dtype's kernel serves here."""
    layout = kind(weight.dtype)
    return (
        layout is not None
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and (layout != AMX or weight.shape[1] % 32 == 0)
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([N, K], `packable`) in its kernel's layout: for AMX, B tiles [N/16, K/32,
    16 (K pairs), 16 (N), 2]; for vectors, blocks of 16 columns [N/16, K, 16]."""
    n, k = weight.shape
    weight = weight.detach()
    if kind(weight.dtype) == BLOCKS:
        return weight.view(n // 16, 16, k).transpose(1, 2).contiguous()
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` for a 2-D `x` [M, K] of `packed`'s dtype and `packed` = `pack(W)`."""
    dtype, blocks = packed.dtype, packed.dim() == 3
    n = packed.shape[0] * 16
    k = packed.shape[1] if blocks else packed.shape[1] * 32
    if x.dim() != 2 or x.shape[1] != k or x.dtype != dtype or x.device.type != "cpu":
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"cpu_gemm.linear: a CPU {name} [M, {k}] input, not {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=dtype, device=x.device)  # the CPU, not the default
    if x.shape[0] == 0:
        return out
    entry = _ENTRY[dtype, blocks]
    served = getattr(LIBRARY.get(), entry)(
        x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, torch.get_num_threads(), out.data_ptr()
    )
    if served != 0:
        raise ValueError(f"cpu_gemm.linear: this build or CPU does not serve {entry}")
    return out


# The entry point for a dtype and layout (blocks or AMX tiles).
_ENTRY = {
    (torch.bfloat16, False): "gemm_bf16",
    (torch.bfloat16, True): "gemm_bf16_blocks",
    (torch.float32, True): "gemm_fp32",
}
_i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_GEMM = ([_ptr, _i64, _i64, _ptr, _i64, _i32, _ptr], _i32)
LIBRARY = cpu_build.Library(
    "cpu_gemm.cpp",
    {
        "gemm_bf16": _GEMM,
        "gemm_bf16_blocks": _GEMM,
        "gemm_fp32": _GEMM,
        "amx_ready": ([], _i32),
        "vec_ready": ([], _i32),
    },
)
