"""Prefill runs with no cached prefix take `causal_attention` over the step's own K/V: the
same result as the paged kernels reading those K/V back from the pages."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import ops, reference, triton_kernels
from halfmoon.kernels.attention import AttentionMetadata, paged_attention


def runs_in_pages(paged_kv, lens, dtype, num_kv_heads=2, ratio=4, head_dim=64, block_size=16):
    """This step's Q/K/V for ragged runs from position 0, with K/V stored in their pages."""
    kv = paged_kv(lens, block_size, num_kv_heads, head_dim, dtype)
    total = sum(lens)
    query = torch.randn(total, num_kv_heads * ratio, head_dim).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    slots = [
        int(kv.block_tables[run, pos // block_size]) * block_size + pos % block_size
        for run, length in enumerate(lens)
        for pos in range(length)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_prefill_tokens=total,
        prefill_cu_seqlens_q=torch.tensor([0, *lens]).cumsum(0).int(),
        prefill_block_tables=kv.block_tables,
        prefill_prefix_lens=torch.zeros(len(lens), dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
    )
    return (query, key, value), kv, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_causal_attention_equals_the_paged_kernels_with_no_prefix(paged_kv, assert_close, dtype):
    lens = [1, 15, 16, 17, 70]
    (query, key, value), kv, meta = runs_in_pages(paged_kv, lens, dtype)
    reference.store_kv(key, value, kv.k_cache, kv.v_cache, meta.slot_mapping)
    paged = (query, kv.k_cache, kv.v_cache, meta.prefill_cu_seqlens_q, kv.block_tables)
    dense = reference.causal_attention(query, key, value, lens, 0.125)
    assert_close(dense, reference.prefill_attention(*paged, meta.prefill_prefix_lens, 0.125))
    assert_close(dense, triton_kernels.prefill_attention(*paged, meta.prefill_prefix_lens, 0.125))


def test_the_dense_path_still_stores_the_runs_kv_in_the_pages(paged_kv, assert_close):
    lens = [5, 33]
    (query, key, value), kv, meta = runs_in_pages(paged_kv, lens, torch.float32)
    paged_out = paged_attention(
        query, key, value, kv.k_cache.clone(), kv.v_cache.clone(), meta, 0.1
    )
    meta.prefill_dense_lens = lens
    out = paged_attention(query, key, value, kv.k_cache, kv.v_cache, meta, 0.1)
    assert_close(out, paged_out)
    rows = kv.k_cache.flatten(0, 1)[meta.slot_mapping.long()]
    assert torch.equal(rows, key)  # decode and the KV publisher read them from the pages


def test_the_policy_is_checked(monkeypatch):
    monkeypatch.setenv(ops.PREFILL_ENV, "paged")
    assert ops.dense_prefill() is False
    monkeypatch.setenv(ops.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match="'auto' or 'paged'"):
        ops.dense_prefill()
