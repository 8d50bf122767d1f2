"""The compiled per-token CPU kernels (`cpu_elementwise`) against their torch references, on
the layouts the model hands them (q and k as strided views of one qkv buffer), and their
fallback to the reference where a layout or dtype is not theirs."""

from __future__ import annotations

import pytest
import torch
from isa_testkit import RUNNABLE, variant

from halfmoon.engine.rope import cos_sin_cache
from halfmoon.kernels import cpu_elementwise, ops, reference

DTYPES = (torch.float32, torch.bfloat16)
DTYPE_IDS = ("fp32", "bf16")


@pytest.fixture(autouse=True, params=RUNNABLE)
def isa(request):
    """Every test once per variant of the kernels this machine runs."""
    with variant(request.param, cpu_elementwise.LIBRARY) as name:
        yield name


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_residual", (False, True))
@pytest.mark.parametrize("dim", (320, 100))  # 100: 16- or 8-lane vectors and a tail of 4
def test_rms_norm_matches_the_reference(assert_close, dtype, with_residual, dim):
    torch.manual_seed(0)
    x, weight = torch.randn(37, dim).to(dtype), torch.randn(dim).to(dtype)
    residual = torch.randn(37, dim).to(dtype) if with_residual else None
    normed, summed = cpu_elementwise.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_summed = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(normed, expected_normed)
    assert torch.equal(summed, expected_summed)  # the add rounds as torch's does


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dim", (64, 40))  # 40: 16- or 8-lane vectors and a tail of 4 a half
def test_rotary_rotates_strided_query_and_key_views_in_place(assert_close, dtype, dim):
    torch.manual_seed(0)
    heads, kv_heads = 8, 2
    qkv = torch.randn(21, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.randint(0, 4096, (21,))
    table = cos_sin_cache(dim, 10000.0, None, 4096)

    def views(buffer):
        q, k, _ = buffer.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        return q.view(-1, heads, dim), k.view(-1, kv_heads, dim)

    expected = qkv.clone()
    reference.rotary_embedding(positions, *views(expected), table)
    cpu_elementwise.rotary_embedding(positions, *views(qkv), table)
    assert_close(qkv, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_matches_the_reference(assert_close, dtype):
    torch.manual_seed(0)
    x = (torch.randn(19, 2 * 352) * 8).to(dtype)  # gates far into both tails
    assert_close(cpu_elementwise.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_store_kv_writes_strided_rows_to_their_slots_and_skips_padding(dtype):
    torch.manual_seed(0)
    kv = torch.randn(6, 2 * 2 * 16).to(dtype)
    key, value = (part.view(6, 2, 16) for part in kv.split([32, 32], dim=-1))
    slots = torch.tensor([5, -1, 0, 63, 17, -1])
    caches = [torch.zeros(4, 16, 2, 16, dtype=dtype) for _ in range(4)]
    reference.store_kv(key, value, caches[0], caches[1], slots)
    cpu_elementwise.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_layouts_and_dtypes_the_kernels_do_not_cover_take_the_reference():
    torch.manual_seed(0)
    half = torch.randn(8, 64).to(torch.float16)  # a dtype the kernels leave to torch
    half_weight = torch.randn(64).to(torch.float16)
    fp32, bf16_weight = torch.randn(4, 64), torch.randn(64).to(torch.bfloat16)  # mixed dtypes
    wide = torch.randn(8, 128)[:, ::2]  # not dense
    for kernel, args in (
        ("rms_norm", (half, half_weight, 1e-5)),
        ("rms_norm", (fp32, bf16_weight, 1e-5)),
        ("silu_and_mul", (wide,)),
    ):
        actual = getattr(cpu_elementwise, kernel)(*args)
        expected = getattr(reference, kernel)(*args)
        for a, e in zip(actual, expected, strict=True):
            assert torch.equal(a, e)


def test_cpu_tensors_take_the_compiled_kernels_unless_torch_is_forced(monkeypatch):
    calls = []
    for module in (cpu_elementwise, reference):
        monkeypatch.setattr(module, "silu_and_mul", lambda x, m=module: calls.append(m))
    ops.silu_and_mul(torch.zeros(2, 8))
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    ops.silu_and_mul(torch.zeros(2, 8))
    assert calls == [cpu_elementwise, reference]
