"""bf16 and fp32 linear layers on CPU run over oneDNN-prepacked weights (decode rows through
cpu_gemm where it serves, else fp32's few rows over the plain weight) and give F.linear's
output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.engine.cpu_linear import PLAIN_ROWS, TILE_ROWS, PackedLinear, pack_linears
from halfmoon.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_packed_linear_matches_f_linear(rows, bias, dtype, tol):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias, dtype=dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        expected, out = linear(x), PackedLinear(linear)(x)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert out.shape == (rows, 80) and out.dtype == dtype


def test_pack_linears_swaps_bf16_and_fp32_linears_and_skips_the_tied_head():
    model = nn.Sequential(
        nn.Linear(32, 32, dtype=torch.bfloat16),
        nn.Sequential(nn.Linear(32, 32, dtype=torch.float32)),
        nn.Linear(32, 32, dtype=torch.float16),
        nn.Linear(32, 32, dtype=torch.bfloat16),
    )
    assert pack_linears(model, skip=(model[3],)) == 2
    kinds = [type(model[0]), type(model[1][0]), type(model[2]), type(model[3])]
    assert kinds == [PackedLinear, PackedLinear, nn.Linear, nn.Linear]


def test_fp32_takes_its_plain_weight_up_to_three_rows():
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=True)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for rows in (1, 2, PLAIN_ROWS):
            x = torch.randn(rows, 96)
            assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))  # MKL's bits
    assert packed.plain is not None and packed.tiles is None
    assert PackedLinear(nn.Linear(96, 80, dtype=torch.bfloat16)).plain is None


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_cpu_gemm_serves_up_to_tile_rows_and_onednn_beyond(monkeypatch, dtype, tol):
    if not cpu_gemm.available(dtype):
        pytest.skip(f"no cpu_gemm kernel for {dtype} here: oneDNN at every row count")
    torch.manual_seed(0)
    linear = nn.Linear(512, 1024, bias=False, dtype=dtype)
    packed = PackedLinear(linear)
    served = []
    tiled = cpu_gemm.linear
    monkeypatch.setattr(
        cpu_gemm, "linear", lambda x, tiles: served.append(len(x)) or tiled(x, tiles)
    )
    with torch.inference_mode():
        for rows in (1, 3, 48, TILE_ROWS, TILE_ROWS + 1):
            x = torch.randn(3, rows, 512, dtype=dtype)[1]  # a view, as the model's
            torch.testing.assert_close(packed(x), F.linear(x, linear.weight), atol=tol, rtol=tol)
    assert served == [1, 3, 48, TILE_ROWS]
    with_bias = PackedLinear(nn.Linear(512, 1024, bias=True, dtype=dtype))
    assert packed.tiles is not None and with_bias.tiles is None  # a bias: oneDNN adds it
    assert packed.plain is None  # the packed copy replaces fp32's plain one: two copies, not 3
