"""Linear layers on CPU (bf16 and fp32) over weights that oneDNN reorders once, at load, into
its blocked layout (AMX for bf16), instead of on every call as `F.linear` does.

Measured on a 2-core AVX-512/AMX machine at this engine's shapes (issue 31). bf16: the four
GEMMs of a BENCH_SHAPE layer 1.2-1.5x faster at 1-256 rows, 1.16x at 2,048; `bench engine` bf16
+6-10 %. fp32: MKL's sgemm behind `F.linear` packs the plain weight on every call from four rows
on, so a whole decode step of the ~50M model (one thread, 300-token contexts) took 41.6 ms at 3
sequences and 56.7 at 8 against 33.5 and 42.0 prepacked; prefill rows (512-2,048) run alike.

For one to three rows (decode at light load) MKL reads the plain fp32 weight at full bandwidth,
where the prepacked one runs 10-15 % slower (the 14 layers' GEMMs of the ~50M model, one
thread: 16.5 / 18.5 / 19.4 ms at 1 / 2 / 3 rows against 18.7 / 21.1 / 21.7 prepacked; served
1+1 at 1 req/s, alternating fresh servers, TPOT 34.5 / 35.6 ms against 37.0 / 40.7). So fp32
keeps its plain weight as well, and an fp32 model's linear weights are held twice; bf16's once
(its prepacked GEMMs are faster at every row count: 12.0-12.3 against 17.4-17.8 ms at 1-3 rows).

bf16 on a CPU with AMX: up to `TILE_ROWS` rows go through `kernels/cpu_gemm.py`'s AMX GEMM over
a copy of the weight packed in its tiles (so these weights are held twice, too). The layers'
GEMMs of the ~50M model (14 layers, 1-64 rows): 1.4-1.65x faster than oneDNN's on one thread
and 1.5-2.2x on two, where oneDNN spends ~18 us a call before it multiplies and splits the
small GEMMs poorly between two threads; on par at 128 rows; oneDNN's 1.35x faster at 2,048.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.kernels import cpu_gemm

# Rows up to which an fp32 layer multiplies by its plain weight (MKL) rather than the prepacked.
PLAIN_ROWS = 3
# Rows up to which a bf16 layer multiplies on AMX tiles (cpu_gemm) rather than through oneDNN.
TILE_ROWS = 128


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a weight in oneDNN's prepacked layout; fp32 over its plain
    weight too, for up to `PLAIN_ROWS` rows; bf16 over AMX tiles, for up to `TILE_ROWS` rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.plain = weight if weight.dtype == torch.float32 else None
        tiled = self.bias is None and cpu_gemm.packable(weight)
        self.tiles = cpu_gemm.pack(weight) if tiled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.plain is not None and rows.shape[0] <= PLAIN_ROWS:
            return F.linear(x, self.plain, self.bias)
        if self.tiles is not None and rows.shape[0] <= TILE_ROWS:
            out = cpu_gemm.linear(rows, self.tiles)
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
