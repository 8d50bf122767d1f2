"""The 8-bit KV cache (kernels/kv_quant.py): rows quantized with their scales, written by every
KV-write kernel alike, read by every attention kernel dequantizing on the fly, and moved as
bytes. Each kernel is checked against the torch reference on the same quantized pages, and the
reference over quantized pages against attention over the values they came from."""

from __future__ import annotations

import os

import pytest
import torch

from halfmoon.kernels import ops, reference, triton_kernels
from halfmoon.kernels.kv_quant import (
    QMAX,
    SCALE_BYTES,
    canonical,
    dequantize,
    head_dim_of,
    quantize,
    row_width,
    storage_dtype,
)

FORMATS = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
FORMAT_IDS = ("int8", "e4m3", "e5m2")
# A row's largest error, relative to its largest magnitude: half an int8 step; e4m3 keeps 3
# mantissa bits (half a step is 2^-4 of a value), e5m2 2 (2^-3); the fp16 scale adds ~1e-3.
ROW_ERROR = {torch.int8: 0.5 / 127 + 1e-3, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


def quantized_kv(lens, block_size, num_kv_heads, head_dim, fmt, paged_kv):
    """`paged_kv`'s random pages, quantized, and the values they dequantize to (fp32)."""
    kv = paged_kv(lens, block_size, num_kv_heads, head_dim, torch.float32)
    k, v = quantize(kv.k_cache, fmt), quantize(kv.v_cache, fmt)
    return kv, k, v


def test_formats_are_named_as_vllm_names_them():
    assert canonical("fp8") == canonical("fp8_e4m3") == "fp8_e4m3"
    assert storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert storage_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert storage_dtype("int8", torch.float32) == torch.int8
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert row_width(64, torch.int8) == 64 + SCALE_BYTES and row_width(64, torch.bfloat16) == 64
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'"):
        canonical("fp4")


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_rows_round_trip_within_their_format_precision(fmt):
    torch.manual_seed(0)
    rows = torch.randn(64, 4, 64) * torch.logspace(-4, 3, 64)[:, None, None]  # 1e-4 .. 1e3
    rows[0] = 0.0  # an all-zero row keeps a usable scale
    rows[1, 0, 5] = 6e4  # one outlier: its row's scale grows, nothing overflows into NaN
    packed = quantize(rows, fmt)
    assert packed.dtype == fmt and packed.shape == (64, 4, 64 + SCALE_BYTES)
    assert head_dim_of(packed) == 64
    back = dequantize(packed, torch.float32)
    assert torch.isfinite(back).all()
    amax = rows.abs().amax(-1, keepdim=True)
    assert ((back - rows).abs() <= ROW_ERROR[fmt] * amax + 1e-30).all()
    assert back[0].eq(0).all()
    scale = packed[..., 64:].contiguous().view(torch.uint8).view(torch.float16).float()
    wanted = amax[2:] / QMAX[fmt]  # no smaller (nothing clamps); an fp16 step larger at most
    assert (scale[2:] >= wanted).all() and (scale[2:] <= wanted * (1 + 2**-10) + 2**-24).all()


# The KV writes: the reference, the engine's dispatch (the compiled CPU write on CPU, Triton on
# CUDA), and Triton (under the interpreter on CPU).
WRITERS = {"torch": reference, "ops": ops}
if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
    WRITERS["triton"] = triton_kernels


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("writer", list(WRITERS))
def test_kv_writes_store_the_same_bytes_as_quantize(writer, fmt):
    torch.manual_seed(1)
    num_tokens, heads, dim = 21, 3, 64
    key, value = torch.randn(num_tokens, heads, dim) * 4, torch.randn(num_tokens, heads, dim)
    slots = torch.randperm(8 * 16)[:num_tokens]
    slots[4] = -1  # padding writes nothing
    k_cache = torch.zeros(8, 16, heads, dim + SCALE_BYTES, dtype=fmt)
    v_cache = torch.zeros_like(k_cache)
    WRITERS[writer].store_kv(key, value, k_cache, v_cache, slots)
    kept = slots >= 0
    for rows, cache in ((key, k_cache), (value, v_cache)):
        written = cache.view(torch.uint8).view(-1, heads, dim + SCALE_BYTES)[slots[kept]]
        assert torch.equal(written, quantize(rows[kept], fmt).view(torch.uint8))
    untouched = torch.ones(8 * 16, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert k_cache.view(torch.uint8).view(8 * 16, -1)[untouched].eq(0).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_attention_over_quantized_pages_stays_near_the_values_they_hold(paged_kv, fmt):
    lens = [1, 15, 16, 17, 300]
    kv, k, v = quantized_kv(lens, 16, 2, 64, fmt, paged_kv)
    query = torch.randn(len(lens), 8, 64)
    args = (kv.block_tables, torch.tensor(lens), 0.125)
    exact = reference.paged_decode_attention(query, kv.k_cache, kv.v_cache, *args)
    quantized = reference.paged_decode_attention(query, k, v, *args)
    same_values = reference.paged_decode_attention(
        query, dequantize(k, torch.float32), dequantize(v, torch.float32), *args
    )
    torch.testing.assert_close(quantized, same_values, atol=1e-5, rtol=1e-5)
    assert (quantized - exact).abs().max() < 4 * ROW_ERROR[fmt]


@pytest.mark.skipif("triton" not in WRITERS, reason="Triton runs with TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("query_dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
def test_the_triton_attention_reads_quantized_pages_as_the_reference(
    paged_kv, assert_close, fmt, query_dtype
):
    lens = [1, 40, 64, 300]
    kv, k, v = quantized_kv(lens, 16, 2, 64, fmt, paged_kv)
    query = torch.randn(len(lens), 8, 64).to(query_dtype)
    tables, seq_lens = kv.block_tables, torch.tensor(lens, dtype=torch.int32)
    decode = (query, k, v, tables, seq_lens, 0.125)
    assert_close(
        triton_kernels.paged_decode_attention(*decode), reference.paged_decode_attention(*decode)
    )
    # Two runs over cached prefixes of 16 and 3 tokens, causal within themselves.
    runs = torch.randn(12, 8, 64).to(query_dtype)
    cu, prefixes = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([16, 3])
    prefill = (runs, k, v, cu, tables[[3, 2]], prefixes.to(torch.int32), 0.125)
    assert_close(triton_kernels.prefill_attention(*prefill), reference.prefill_attention(*prefill))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_pages_move_as_bytes_values_and_scales_alike(fmt):
    torch.manual_seed(2)
    cache = quantize(torch.randn(10, 16, 2, 64), fmt)
    pages = torch.tensor([7, 2, 9])
    gathered = ops.gather_pages(cache, pages)
    assert gathered.dtype == fmt and gathered.shape == (3, 16, 2, 66)
    target = torch.zeros_like(cache)
    ops.scatter_pages(target, torch.tensor([0, 1, 5]), gathered)
    assert torch.equal(target[[0, 1, 5]].view(torch.uint8), cache[pages].view(torch.uint8))
