"""The decode GEMMs of `cpu_gemm` against matmuls in wider precision and torch's linear: bf16 on
AMX (every row count from 1 to past a tile group, this engine's layer shapes, both thread
counts alike, the tile state it borrows left as oneDNN expects), and on vectors (each variant
this machine runs: AVX-512, AVX2) fp32 and bf16 (row and K tails, each row's result independent
of its batch and the threads); the shapes each declines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_testkit import RUNNABLE, VECTOR, variant

from halfmoon.kernels import cpu_gemm


@pytest.fixture
def amx():
    """The `amx` variant, where this CPU has AMX and Linux lends it to this process."""
    if "amx" not in RUNNABLE:
        pytest.skip("this CPU has no AMX: its bf16 GEMMs take the vector kernels or oneDNN")
    with variant("amx", cpu_gemm.LIBRARY):
        if cpu_gemm.kind(torch.bfloat16) != cpu_gemm.AMX:
            pytest.skip("Linux did not lend this process the AMX tiles (arch_prctl refused)")
        yield


@pytest.fixture(params=VECTOR)
def vector(request):
    """Each variant with vector GEMMs this machine runs (AVX-512 ones, AVX2)."""
    with variant(request.param, cpu_gemm.LIBRARY):
        assert cpu_gemm.kind(torch.float32) == cpu_gemm.BLOCKS
        yield request.param


def weight_and_rows(rows: int, k: int, n: int):
    torch.manual_seed(rows)
    return torch.randn(n, k).to(torch.bfloat16), torch.randn(rows, k).to(torch.bfloat16)


@pytest.mark.usefixtures("amx")
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


@pytest.mark.usefixtures("amx")
def test_threads_share_the_columns_without_changing_a_bit():
    weight, x = weight_and_rows(40, 512, 1024)
    one, two = on_one_and_two_threads(x, cpu_gemm.pack(weight))
    assert torch.equal(one, two)  # a block of columns is one thread's, all of its K


def on_one_and_two_threads(x: torch.Tensor, packed: torch.Tensor):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, packed)
        torch.set_num_threads(2)
        return one, cpu_gemm.linear(x, packed)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("amx")
def test_onednn_gemms_give_the_same_bits_after_it_ran():
    weight, x = weight_and_rows(300, 512, 1024)
    before = F.linear(x, weight)
    cpu_gemm.linear(x[:7], cpu_gemm.pack(weight))
    assert torch.equal(F.linear(x, weight), before)


@pytest.mark.usefixtures("amx")
def test_shapes_it_does_not_serve_are_declined_or_refused():
    assert not cpu_gemm.packable(torch.zeros(20, 64, dtype=torch.bfloat16))  # N not 16s
    assert not cpu_gemm.packable(torch.zeros(32, 48, dtype=torch.bfloat16))  # K not 32s
    assert not cpu_gemm.packable(torch.zeros(32, 64, dtype=torch.float16))
    packed = cpu_gemm.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        cpu_gemm.linear(torch.zeros(3, 32, dtype=torch.bfloat16), packed)
    assert cpu_gemm.linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 32)


@pytest.mark.usefixtures("vector")
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 6, 7, 13, 64, 128, 130))
@pytest.mark.parametrize(("k", "n"), ((512, 1024), (1792, 512), (2100, 48), (200, 80), (7, 16)))
def test_fp32_rows_match_an_fp64_matmul(rows, k, n):
    """Rows past a tile of six and K past a sweep of 2,048 steps, and their tails."""
    torch.manual_seed(rows)
    weight, x = torch.randn(n, k), torch.randn(rows, k)
    out = cpu_gemm.linear(x, cpu_gemm.pack(weight))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("vector")
def test_fp32_rows_do_not_depend_on_their_batch_or_the_threads():
    """Each row's sums run in K order: alone, at any place in a batch, on one or two threads."""
    torch.manual_seed(0)
    weight, x = torch.randn(1024, 512), torch.randn(37, 512)
    packed = cpu_gemm.pack(weight)
    one, two = on_one_and_two_threads(x, packed)
    assert torch.equal(one, two)
    for row in (0, 5, 6, 36):
        assert torch.equal(cpu_gemm.linear(x[row : row + 1], packed)[0], one[row])


@pytest.mark.usefixtures("vector")
def test_fp32_shapes_it_does_not_serve_are_declined_or_refused():
    assert cpu_gemm.packable(torch.zeros(32, 7))  # any K
    assert not cpu_gemm.packable(torch.zeros(20, 64))  # N not 16s
    packed = cpu_gemm.pack(torch.zeros(32, 64))
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        cpu_gemm.linear(torch.zeros(3, 64, dtype=torch.bfloat16), packed)
    assert cpu_gemm.linear(torch.zeros(0, 64), packed).shape == (0, 32)


@pytest.mark.usefixtures("vector")
@pytest.mark.parametrize("rows", (1, 2, 7, 64, 130, 241, 500))
@pytest.mark.parametrize(("k", "n"), ((512, 1024), (1792, 512), (2100, 48), (7, 80)))
def test_bf16_blocks_match_an_fp32_matmul_rounded_once(rows, k, n):
    """bf16 weights widened on load: fp32 sums in K order, each result rounded once (rows
    past a 240-row chunk too)."""
    weight, x = weight_and_rows(rows, k, n)
    packed = cpu_gemm.pack(weight)
    assert packed.shape == (n // 16, k, 16)
    out = cpu_gemm.linear(x, packed)
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.usefixtures("vector")
def test_bf16_blocks_rows_do_not_depend_on_their_batch_or_the_threads():
    weight, x = weight_and_rows(250, 512, 1024)
    packed = cpu_gemm.pack(weight)
    one, two = on_one_and_two_threads(x, packed)
    assert torch.equal(one, two)
    for row in (0, 5, 239, 249):
        assert torch.equal(cpu_gemm.linear(x[row : row + 1], packed)[0], one[row])


def test_the_generic_variant_has_no_vector_gemm_and_says_so():
    with variant("generic", cpu_gemm.LIBRARY):
        assert cpu_gemm.kind(torch.float32) is None and cpu_gemm.kind(torch.bfloat16) is None
        assert not cpu_gemm.packable(torch.zeros(32, 64))
