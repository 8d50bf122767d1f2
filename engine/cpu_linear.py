"""bf16 linear layers on CPU over weights that oneDNN reorders once, at load, into its blocked
(AMX) layout, instead of on every call as `F.linear` does.

Measured on a 2-core AVX-512/AMX machine at this engine's shapes (issue 31): the four GEMMs of a
BENCH_SHAPE layer 1.2-1.5x faster at 1-256 rows, 1.16x at 2,048; `bench engine` bf16 +6-10 %.
fp32 stays on `F.linear`: no packing measured faster end to end (MKL's sgemm on a `[in, out]`
weight won 1.0-1.5x per GEMM and nothing overall; oneDNN's fp32 layout loses at one row).
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a bf16 weight in oneDNN's prepacked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Swap every CPU bf16 `nn.Linear` of `model` but those in `skip` for a `PackedLinear`,
    once its weights are loaded; returns how many were swapped."""
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
    """A CPU bf16 `nn.Linear`, where oneDNN is built in."""
    return (
        isinstance(module, nn.Linear)
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
    )
