"""`ops` routes to the Triton kernels when `HALFMOON_KERNELS=triton`, on CPU tensors too."""

from __future__ import annotations

import torch

from halfmoon.kernels import ops, triton_kernels
from halfmoon.kernels.attention import AttentionMetadata, paged_attention


def mixed_step(block_size: int = 16, num_kv_heads: int = 2, ratio: int = 4, head_dim: int = 64):
    """Two prefill runs (one over a cached prefix) then two decoding sequences, as one step."""
    torch.manual_seed(0)
    # Pages 0-3: run 0 (20 new); 4-7: run 1 (40 cached + 9 new); 8-9, 10-12: decoders.
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1], [10, 11, 12, -1]])
    prefill_slots = [*range(0, 20), *range(4 * 16 + 40, 4 * 16 + 49)]
    decode_lens = [17, 33]
    decode_slots = [8 * 16 + 16, 10 * 16 + 32]
    num_tokens = len(prefill_slots) + len(decode_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(prefill_slots + decode_slots),
        num_prefill_tokens=len(prefill_slots),
        prefill_cu_seqlens_q=torch.tensor([0, 20, 29], dtype=torch.int32),
        prefill_block_tables=tables[:2].int(),
        prefill_prefix_lens=torch.tensor([0, 40], dtype=torch.int32),
        decode_block_tables=tables[2:].int(),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32),
    )
    k_cache = torch.randn(13, block_size, num_kv_heads, head_dim)
    qkv = (
        torch.randn(num_tokens, num_kv_heads * ratio, head_dim),
        torch.randn(num_tokens, num_kv_heads, head_dim),
        torch.randn(num_tokens, num_kv_heads, head_dim),
    )
    return qkv, k_cache, torch.randn_like(k_cache), meta


def run_step(monkeypatch, backend: str):
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    (query, key, value), k_cache, v_cache, meta = mixed_step()
    out = paged_attention(query, key, value, k_cache, v_cache, meta, scale=0.125)
    return out, k_cache, v_cache


def test_forced_triton_backend_serves_cpu_tensors(monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, "triton")
    assert ops.backend_for(torch.zeros(1)) is triton_kernels


def test_attention_step_through_ops_matches_between_triton_and_torch(monkeypatch):
    out, k_cache, v_cache = run_step(monkeypatch, "triton")
    expected, expected_k, expected_v = run_step(monkeypatch, "torch")
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
