"""Triton KV row scatter and page gather/scatter against the torch references: exact copies."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import reference, triton_kernels

DTYPES = (torch.float32, torch.float16)
DTYPE_IDS = ("fp32", "fp16")


def random_cache(block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype):
    torch.manual_seed(0)
    return torch.randn(9, block_size, num_heads, head_dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "head_dim"), [(1, 64), (2, 128), (8, 64)])
def test_store_kv_writes_each_row_to_its_slot_and_skips_negative_slots(
    dtype, block_size, num_heads, head_dim
):
    k_cache = random_cache(block_size, num_heads, head_dim, dtype)
    v_cache = torch.randn_like(k_cache)
    # K and V as strided views of one fused projection, as the model produces them.
    fused = torch.randn(block_size + 5, 2, num_heads, head_dim).to(dtype)
    key, value = fused[:, 0], fused[:, 1]
    slots = torch.randperm(k_cache.shape[0] * block_size)[: key.shape[0]]
    slots[[0, 3]] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    triton_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_store_kv_casts_rows_to_the_cache_dtype():
    k_cache = random_cache(16, 2, 64, torch.float16)
    v_cache = torch.randn_like(k_cache)
    key, value = torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    slots = torch.tensor([0, 15, 16, 17, 40, -1, 143])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    triton_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gather_then_scatter_pages_round_trips_the_listed_pages(dtype, block_size, head_dim):
    cache = random_cache(block_size, 2, head_dim, dtype)
    page_ids = torch.tensor([7, 0, 3, 8], dtype=torch.int32)
    buffer = triton_kernels.gather_pages(cache, page_ids)
    assert buffer.is_contiguous()
    assert torch.equal(buffer, reference.gather_pages(cache, page_ids))
    target = torch.zeros_like(cache)
    triton_kernels.scatter_pages(target, page_ids, buffer)
    expected = torch.zeros_like(cache)
    reference.scatter_pages(expected, page_ids, buffer)
    assert torch.equal(target, expected)


def test_gather_pages_of_no_pages_is_an_empty_buffer():
    cache = random_cache(16, 2, 64, torch.float16)
    buffer = triton_kernels.gather_pages(cache, torch.tensor([], dtype=torch.int64))
    assert buffer.shape == (0, 16, 2, 64)


def test_pages_of_a_strided_pool_slice_are_gathered_and_scattered():
    # One tensor holding K and V for every layer; a layer's K is a strided view of it.
    pool = torch.randn(3, 2, 9, 16, 2, 64)
    cache = pool[1, 0]
    page_ids = torch.tensor([2, 5])
    buffer = triton_kernels.gather_pages(cache, page_ids)
    assert torch.equal(buffer, cache[page_ids])
    triton_kernels.scatter_pages(cache, torch.tensor([0, 1]), buffer)
    assert torch.equal(pool[1, 0, :2], buffer)
