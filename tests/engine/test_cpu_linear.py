"""bf16 and fp32 linear layers on CPU run over the layouts each kernel variant serves (decode
rows through cpu_gemm where it serves, oneDNN's prepacked weights where it serves the dtype,
the plain weight for the rest) and give F.linear's output, on every variant this CPU runs and
where oneDNN cannot prepack bf16 (an AVX2 CPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from isa_testkit import RUNNABLE, variant
from torch import nn

from halfmoon.engine import cpu_linear
from halfmoon.engine.cpu_linear import (
    BF16_BLOCK_ROWS,
    PLAIN_ROWS,
    TILE_ROWS,
    PackedLinear,
    pack_linears,
)
from halfmoon.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


@pytest.fixture(params=RUNNABLE)
def isa(request):
    """Each kernel variant this machine runs (the layers' paths are chosen at construction)."""
    with variant(request.param, cpu_gemm.LIBRARY) as name:
        yield name


@pytest.fixture
def no_onednn_bf16(monkeypatch):
    """torch refusing to prepack bf16, as on an AVX2 CPU ("bf16 path needs the cpu support
    avx_ne_convert or avx512bw, avx512vl and avx512dq")."""

    def reorder(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")
        return original(weight, *args)

    original = torch.ops.mkldnn._reorder_linear_weight
    cpu_linear._prepack_works.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)
    yield
    cpu_linear._prepack_works.cache_clear()


@pytest.mark.usefixtures("isa")
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
def test_cpu_gemm_serves_up_to_its_rows_and_onednn_beyond(isa, monkeypatch, dtype, tol):
    if not cpu_gemm.available(dtype):
        pytest.skip(f"the {isa} variant has no cpu_gemm kernel for {dtype}")
    torch.manual_seed(0)
    linear = nn.Linear(512, 1024, bias=False, dtype=dtype)
    packed = PackedLinear(linear)
    served = []
    tiled = cpu_gemm.linear
    monkeypatch.setattr(
        cpu_gemm, "linear", lambda x, tiles: served.append(len(x)) or tiled(x, tiles)
    )
    limit = packed.tile_rows
    expected = TILE_ROWS if packed.layout == "amx" or dtype == torch.float32 else BF16_BLOCK_ROWS
    assert limit == (expected if packed.weight is not None else math.inf)
    counts = (1, 3, 48, TILE_ROWS, TILE_ROWS + 1)
    with torch.inference_mode():
        for rows in counts:
            x = torch.randn(3, rows, 512, dtype=dtype)[1]  # a view, as the model's
            torch.testing.assert_close(packed(x), F.linear(x, linear.weight), atol=tol, rtol=tol)
    assert served == [rows for rows in counts if rows <= limit]
    with_bias = PackedLinear(nn.Linear(512, 1024, bias=True, dtype=dtype))
    assert packed.tiles is not None and with_bias.tiles is None  # a bias: oneDNN or torch adds it
    assert packed.plain is None  # the packed copy replaces fp32's plain one: two copies, not 3


@pytest.mark.usefixtures("no_onednn_bf16")
@pytest.mark.parametrize("rows", [1, 7, 200, 300])
def test_bf16_loads_and_runs_where_onednn_cannot_prepack_it(isa, rows):
    torch.manual_seed(0)
    linear = nn.Linear(512, 1024, bias=False, dtype=torch.bfloat16)
    with_bias = nn.Linear(512, 1024, bias=True, dtype=torch.bfloat16)
    x = torch.randn(rows, 512, dtype=torch.bfloat16)
    with torch.inference_mode():
        for layer in (linear, with_bias):
            packed = PackedLinear(layer)
            assert packed.weight is None
            torch.testing.assert_close(packed(x), layer(x), atol=1e-2, rtol=1e-2)
    vector = isa != "generic"
    # Vectors serve every row count with the weight held once; else (or with a bias) torch's.
    assert PackedLinear(linear).path == ("blocks" if vector else "plain")
    assert PackedLinear(with_bias).path == "plain"


def test_an_avx2_variant_never_prepacks_bf16_with_onednn():
    if "avx2" not in RUNNABLE:
        pytest.skip("this CPU cannot run the avx2 variant")
    with variant("avx2", cpu_gemm.LIBRARY):
        assert not cpu_linear.onednn_prepacks(torch.bfloat16)
        assert cpu_linear.onednn_prepacks(torch.float32)
        layer = PackedLinear(nn.Linear(512, 1024, bias=False, dtype=torch.bfloat16))
        assert layer.weight is None and layer.path == "blocks"


def test_paths_counts_each_layers_path():
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 8, dtype=torch.float16))
    pack_linears(model)
    expected = {model[0].path: 1, "nn.Linear": 1}
    assert cpu_linear.paths(model) == expected
