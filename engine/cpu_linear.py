"""Linear layers on CPU (bf16 and fp32) over weights that oneDNN reorders once, at load, into
its blocked layout (AMX for bf16), instead of on every call as `F.linear` does.

Measured on a 2-core AVX-512/AMX machine at this engine's shapes (issue 31). bf16: the four
GEMMs of a BENCH_SHAPE layer 1.2-1.5x faster at 1-256 rows, 1.16x at 2,048; `bench engine` bf16
+6-10 %. fp32: MKL's sgemm behind `F.linear` packs the plain weight on every call from four rows
on, so a whole decode step of the ~50M model (one thread, 300-token contexts) took 41.6 ms at 3
sequences and 56.7 at 8 against 33.5 and 42.0 prepacked; prefill rows (512-2,048) run alike.

Up to `TILE_ROWS` rows (decode's) go through `kernels/cpu_gemm.py` over a second copy of the
weight packed for it, where its kernel serves (a weight of whole 16-column blocks, no bias):
- bf16 on AMX tiles. The layers' GEMMs of the ~50M model (14 layers, 1-64 rows): 1.4-1.65x
  faster than oneDNN's on one thread and 1.5-2.2x on two, where oneDNN spends ~18 us a call
  before it multiplies and splits the small GEMMs poorly between two threads; on par at 128
  rows; oneDNN's 1.35x faster at 2,048.
- fp32 on AVX-512 FMA: 1.05-1.3x faster than oneDNN's at 4-128 rows, one or two threads, and
  1.15-1.25x faster than MKL over the plain weight at one to three rows (oneDNN's prepacked
  GEMM is 10-15 % slower than MKL there).
An fp32 layer the kernel does not serve keeps its plain weight for up to `PLAIN_ROWS` rows
(MKL) instead. So an fp32 layer's weight is held twice either way, a bf16 one's where AMX
serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.kernels import cpu_gemm

# Rows up to which an fp32 layer multiplies by its plain weight (MKL) rather than the prepacked.
PLAIN_ROWS = 3
# Rows up to which a layer multiplies through cpu_gemm (AMX tiles, fp32 blocks), not oneDNN.
TILE_ROWS = 128


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight in oneDNN's prepacked layout, and for up to
    `TILE_ROWS` rows over `tiles`, the weight packed for cpu_gemm, where that serves; an fp32
    layer it does not serve keeps its plain weight for up to `PLAIN_ROWS` rows instead."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        tiled = self.bias is None and cpu_gemm.packable(weight)
        self.tiles = cpu_gemm.pack(weight) if tiled else None
        self.plain = weight if weight.dtype == torch.float32 and not tiled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.tiles is not None and rows.shape[0] <= TILE_ROWS:
            out = cpu_gemm.linear(rows, self.tiles)
        elif self.plain is not None and rows.shape[0] <= PLAIN_ROWS:
            return F.linear(x, self.plain, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Swap every CPU bf16 or fp32 `nn.Linear` of `model` but those in `skip` for a
    `PackedLinear`, once its weights are loaded; returns how many were swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if packable(child) and not any(child is other for other in skip)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def packable(module: nn.Module) -> bool:
    """A CPU bf16 or fp32 `nn.Linear`, where oneDNN is built in."""
    return (
        isinstance(module, nn.Linear)
        and module.weight.device.type == "cpu"
        and module.weight.dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )
