"""The SwiGLU MLP of a decoder layer (and of a mixture-of-experts' shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from halfmoon.engine.tensor_parallel import TPGroup
from halfmoon.kernels import ops


class MLP(nn.Module):
    """This rank's `size` rows of the intermediate size (the whole of it over the group):
    `gate_up_proj` column-, `down_proj` row-parallel."""

    def __init__(self, hidden_size: int, size: int, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.gate_up_proj = nn.Linear(hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output, before the sum over the ranks."""
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
