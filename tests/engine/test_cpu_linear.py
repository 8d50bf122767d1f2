"""bf16 linear layers on CPU run over oneDNN-prepacked weights and give F.linear's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from halfmoon.engine.cpu_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_in_bf16(rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, out = linear(x), PackedLinear(linear)(x)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    assert out.shape == (rows, 80) and out.dtype == torch.bfloat16


def test_pack_linears_swaps_only_bf16_linears_and_skips_the_tied_head():
    model = nn.Sequential(
        nn.Linear(32, 32, dtype=torch.bfloat16),
        nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16)),
        nn.Linear(32, 32, dtype=torch.float32),
        nn.Linear(32, 32, dtype=torch.bfloat16),
    )
    assert pack_linears(model, skip=(model[3],)) == 2
    kinds = [type(model[0]), type(model[1][0]), type(model[2]), type(model[3])]
    assert kinds == [PackedLinear, PackedLinear, nn.Linear, nn.Linear]
