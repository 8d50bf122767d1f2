"""The compiled CPU kernels over an 8-bit KV cache (kernels/kv_quant.py), in every variant this
machine runs: the KV write quantizes bit for bit as the torch reference does, and the decode
attention reads quantized pages as the reference reads them. (CPU tensors on any host.)"""

from __future__ import annotations

import pytest
import torch
from isa_testkit import RUNNABLE, variant

from halfmoon.kernels import cpu_attention, cpu_elementwise, reference
from halfmoon.kernels.kv_quant import quantize

FORMATS = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
FORMAT_IDS = ("int8", "e4m3", "e5m2")


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("isa", RUNNABLE)
def test_the_compiled_kv_write_quantizes_bit_for_bit_in_every_variant(isa, dtype, fmt):
    torch.manual_seed(3)
    # Rows from 1e-6 to 1e4 in size (fp16 scales subnormal to large), a zero row, ties.
    key = (torch.randn(70, 4, 64) * torch.logspace(-6, 4, 70)[:, None, None]).to(dtype)
    key[5] = 0.0
    key[6, 0] = torch.arange(64) - 32.0  # whole values: the row's halves are exact ties
    value = torch.randn(70, 4, 64).to(dtype)
    slots = torch.randperm(20 * 16)[:70]
    caches = [torch.zeros(20, 16, 4, 66, dtype=fmt) for _ in range(4)]
    with variant(isa, cpu_elementwise.LIBRARY):
        cpu_elementwise.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    for ours, theirs in zip(caches[:2], caches[2:], strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.fixture(params=RUNNABLE)
def native(request):
    """The compiled decode kernel, in each variant this machine runs."""
    with variant(request.param, cpu_attention.LIBRARY):
        yield cpu_attention


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("query_dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize(("head_dim", "ratio"), [(64, 2), (128, 4), (32, 3)])
def test_the_cpu_decode_kernel_reads_quantized_pages_as_the_reference(
    native, paged_kv, assert_close, fmt, query_dtype, head_dim, ratio
):
    lens = [17, 1, 700, 16, 15, 64, 33]  # unsorted, page edges; 32: off the vector path
    kv = paged_kv(lens, 16, 2, head_dim, torch.float32)
    k, v = quantize(kv.k_cache, fmt), quantize(kv.v_cache, fmt)
    query = torch.randn(len(lens), 2 * ratio, head_dim).to(query_dtype)
    assert native.supports(query, k, v)
    args = (query, k, v, kv.block_tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5)
    assert_close(native.paged_decode_attention(*args), reference.paged_decode_attention(*args))
