"""Triton RMSNorm (with the fused residual add) and rotary embedding against the references."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import reference, triton_kernels

DTYPES = (torch.float32, torch.float16)
DTYPE_IDS = ("fp32", "fp16")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 96, 4096])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference_and_returns_the_summed_residual(
    assert_close, dtype, hidden, with_residual
):
    torch.manual_seed(0)
    x = torch.randn(2, 5, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(2, 5, hidden).to(dtype) if with_residual else None
    normed, new_residual = triton_kernels.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(normed, expected_normed)
    assert torch.equal(new_residual, expected_residual)
    if residual is None:
        assert new_residual is x


def rope_cache(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_rotates_strided_query_and_key_in_place(
    assert_close, dtype, ratio, head_dim
):
    torch.manual_seed(0)
    num_kv_heads, num_tokens = 2, 11
    num_q_heads = num_kv_heads * ratio
    # q and k are column slices of one fused projection, so neither is contiguous.
    fused = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_width = num_q_heads * head_dim
    query = fused[:, :q_width].view(num_tokens, num_q_heads, head_dim)
    key = fused[:, q_width : q_width + num_kv_heads * head_dim].view(num_tokens, num_kv_heads, -1)
    value_before = fused[:, q_width + num_kv_heads * head_dim :].clone()
    expected_q, expected_k = query.clone(), key.clone()
    positions = torch.randint(0, 500, (num_tokens,))
    cache = rope_cache(500, head_dim)
    reference.rotary_embedding(positions, expected_q, expected_k, cache)
    triton_kernels.rotary_embedding(positions, query, key, cache)
    assert_close(query, expected_q)
    assert_close(key, expected_k)
    assert torch.equal(fused[:, q_width + num_kv_heads * head_dim :], value_before)
