"""Linear layers on CPU (bf16 and fp32), each over the weight layouts this CPU serves best,
chosen once at load by what the CPU has (`kernels/cpu_build.py`'s variant), never by a crash.

The paths a layer may take, by rows (M) of a call:
- `kernels/cpu_gemm.py` over the weight packed for it: bf16 on AMX tiles, or on vectors
  (AVX-512 or AVX2 FMA) fp32 and bf16 widened to fp32 sums. Where oneDNN also serves the dtype,
  up to `TILE_ROWS` rows (decode's; bf16 widened, `BF16_BLOCK_ROWS`); where it cannot (bf16 on
  an AVX2 CPU: torch refuses to prepack it there, "bf16 path needs the cpu support
  avx_ne_convert or avx512bw, avx512vl and avx512dq"), at every row count.
- oneDNN's prepacked GEMM (`_reorder_linear_weight` once at load, instead of on every call
  as `F.linear` does): fp32 on any CPU, bf16 on AVX-512; above `TILE_ROWS` rows, or at every
  count where cpu_gemm does not serve the layer.
- `F.linear` over the plain weight: an fp32 layer cpu_gemm does not serve, up to `PLAIN_ROWS`
  rows (MKL packs the plain weight itself from four rows on); any layer neither of the others
  serves (the `generic` variant's bf16).

Measured on a 2-core AVX-512/AMX machine at this engine's shapes (issue 31). bf16: oneDNN's
prepacked GEMMs 1.2-1.5x faster than `F.linear` at 1-256 rows; AMX tiles 1.4-1.65x faster than
oneDNN at 1-64 rows on one thread, 1.5-2.2x on two, on par at 128. fp32: the AVX-512 blocks
1.05-1.3x faster than oneDNN at 4-128 rows and 1.15-1.25x faster than MKL at one to three. So
an fp32 layer's weight is held twice (packed for both), a bf16 one's on AVX-512 (AMX tiles or
blocks beside oneDNN's); a bf16 layer on AVX2 holds its weight once, as cpu_gemm's blocks.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.kernels import cpu_build, cpu_gemm

# Rows up to which an fp32 layer multiplies by its plain weight (MKL) rather than the prepacked.
PLAIN_ROWS = 3
# Rows up to which a layer multiplies through cpu_gemm, not oneDNN, where both serve it: AMX
# tiles and fp32 vectors to decode's 128; bf16 widened on vectors to 4, past which oneDNN's
# AVX-512 BF16 dot products (two products an instruction) win (Zen 4: 1.08-1.44x faster to 4
# rows on one thread, 0.54-0.72x from 8).
TILE_ROWS = 128
BF16_BLOCK_ROWS = 4
# The variants whose CPUs oneDNN prepacks bf16 for (AVX-512 BW, VL and DQ).
_ONEDNN_BF16_ISAS = frozenset({"amx", "avx512bf16", "avx512"})


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over the weight layouts this CPU serves (see the module's
    docstring): `tiles` (cpu_gemm's) up to `tile_rows`, `plain` up to `plain_rows`, and
    `weight` (oneDNN's prepacked) for the rest."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        onednn = onednn_prepacks(weight.dtype)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn else None
        tiled = self.bias is None and cpu_gemm.packable(weight)
        self.tiles = cpu_gemm.pack(weight) if tiled else None
        fp32 = weight.dtype == torch.float32
        self.plain = weight if not tiled and (fp32 or not onednn) else None
        self.tile_rows = _tile_rows(self.layout, weight.dtype, onednn)
        self.plain_rows = PLAIN_ROWS if onednn else math.inf

    @property
    def layout(self) -> str | None:
        """cpu_gemm's layout of `tiles` (`amx` or `blocks`), or None."""
        return None if self.tiles is None else "amx" if self.tiles.dim() == 5 else "blocks"

    @property
    def path(self) -> str:
        """Which paths serve this layer and up to how many rows, e.g. `blocks<=128 onednn`."""
        return _path(self.layout, self.plain is not None, self.weight is not None, self.tile_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.tiles is not None and rows.shape[0] <= self.tile_rows:
            out = cpu_gemm.linear(rows, self.tiles)
        elif self.plain is not None and rows.shape[0] <= self.plain_rows:
            return F.linear(x, self.plain, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def _tile_rows(layout: str | None, dtype: torch.dtype, onednn: bool) -> float:
    """Rows up to which cpu_gemm serves a layer of `layout` (every count where oneDNN does not)."""
    if not onednn:
        return math.inf
    return BF16_BLOCK_ROWS if layout == "blocks" and dtype == torch.bfloat16 else TILE_ROWS


def _path(layout: str | None, plain: bool, onednn: bool, tile_rows: float) -> str:
    parts = []
    if layout is not None:
        parts.append(f"{layout}<={tile_rows}" if onednn else layout)
    if plain:
        parts.append(f"plain<={PLAIN_ROWS}" if onednn else "plain")
    return " ".join([*parts, "onednn"] if onednn else parts)


def plan(dtype: torch.dtype) -> str:
    """The path a `dtype` layer of whole 16-column blocks and no bias takes here (`path`)."""
    onednn, layout = onednn_prepacks(dtype), cpu_gemm.kind(dtype)
    plain = layout is None and (dtype == torch.float32 or not onednn)
    return _path(layout, plain, onednn, _tile_rows(layout, dtype, onednn))


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """The kernels an engine on `device` in `dtype` runs, in a few words: on CPU the kernels'
    variant (`kernels/cpu_build.py`) and the linear layers' `plan`."""
    if device.type != "cpu":
        return f"{device.type}: triton kernels, torch linear"
    return f"{cpu_build.current().name} kernels, linear {plan(dtype)}"


def onednn_prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks `dtype` weights here: fp32 wherever torch has oneDNN; bf16 where
    the kernels' variant is an AVX-512 one and torch accepts it (asked once, on a small
    weight), so that `HALFMOON_CPU_ISA=avx2` runs what an AVX2 CPU runs."""
    if dtype == torch.bfloat16 and cpu_build.current().name not in _ONEDNN_BF16_ISAS:
        return False
    return _prepack_works(dtype)


@cache
def _prepack_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


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
    """A CPU bf16 or fp32 `nn.Linear` that oneDNN or cpu_gemm serves."""
    return (
        isinstance(module, nn.Linear)
        and module.weight.device.type == "cpu"
        and module.weight.dtype in (torch.bfloat16, torch.float32)
        and (onednn_prepacks(module.weight.dtype) or cpu_gemm.packable(module.weight))
    )


def paths(model: nn.Module) -> dict[str, int]:
    """How many of `model`'s linear layers take each path (`PackedLinear.path`; `nn.Linear`
    for those left to torch)."""
    counted = Counter(
        m.path if isinstance(m, PackedLinear) else "nn.Linear"
        for m in model.modules()
        if isinstance(m, PackedLinear | nn.Linear)
    )
    return dict(sorted(counted.items()))
