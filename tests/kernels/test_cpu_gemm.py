"""The AMX decode GEMM of `cpu_gemm` against fp32 matmul and oneDNN's bf16 linear: every row
count from 1 to past a tile group, this engine's layer shapes, both thread counts alike; the
AMX tile state it borrows left as oneDNN expects; and the shapes it declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from halfmoon.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(
    not cpu_gemm.available(), reason="no AMX (or no C++ compiler): oneDNN serves"
)


def weight_and_rows(rows: int, k: int, n: int):
    torch.manual_seed(rows)
    return torch.randn(n, k).to(torch.bfloat16), torch.randn(rows, k).to(torch.bfloat16)


@pytest.mark.parametrize("rows", (1, 2, 15, 16, 17, 33, 48, 64, 65, 130))
@pytest.mark.parametrize(("k", "n"), ((512, 1024), (512, 512), (1792, 512), (64, 48)))
def test_rows_match_an_fp32_matmul_rounded_once(rows, k, n):
    weight, x = weight_and_rows(rows, k, n)
    out = cpu_gemm.linear(x, cpu_gemm.pack(weight))
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # fp32 sums in another order: at most one bf16 step apart (2^-7 of the value)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=2**-7, atol=1e-2)


def test_threads_share_the_columns_without_changing_a_bit():
    weight, x = weight_and_rows(40, 512, 1024)
    packed, threads = cpu_gemm.pack(weight), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, packed)
        torch.set_num_threads(2)
        two = cpu_gemm.linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # a block of columns is one thread's, all of its K


def test_onednn_gemms_give_the_same_bits_after_it_ran():
    weight, x = weight_and_rows(300, 512, 1024)
    before = F.linear(x, weight)
    cpu_gemm.linear(x[:7], cpu_gemm.pack(weight))
    assert torch.equal(F.linear(x, weight), before)


def test_shapes_it_does_not_serve_are_declined_or_refused():
    assert not cpu_gemm.packable(torch.zeros(20, 64, dtype=torch.bfloat16))  # N not 16s
    assert not cpu_gemm.packable(torch.zeros(32, 48, dtype=torch.bfloat16))  # K not 32s
    assert not cpu_gemm.packable(torch.zeros(32, 64))  # fp32
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        cpu_gemm.linear(torch.zeros(3, 32, dtype=torch.bfloat16), packed)
    assert cpu_gemm.linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)
