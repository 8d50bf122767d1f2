"""Triton decode and prefill attention against the torch references, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import reference, triton_kernels
from halfmoon.kernels.triton_decode import SplitPlan, plan_splits

HEAD_DIMS = (64, 128)
RATIOS = (1, 4, 8)
BLOCK_SIZES = (16, 32)
DTYPES = (torch.float32, torch.float16)
DTYPE_IDS = ("fp32", "fp16")


def edge_lengths(block_size: int) -> list[int]:
    """1, one short of a page, a page, one past a page, and a few hundred tokens."""
    return [1, block_size - 1, block_size, block_size + 1, 300]


def run_decode(
    paged_kv, lens, block_size, num_kv_heads, ratio, head_dim, dtype, index_dtype=torch.int32
):
    kv = paged_kv(lens, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=index_dtype)
    tables = kv.block_tables.to(index_dtype)
    args = (query, kv.k_cache, kv.v_cache, tables, seq_lens, head_dim**-0.5)
    return triton_kernels.paged_decode_attention(*args), reference.paged_decode_attention(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention_matches_reference_on_ragged_page_edge_lengths(
    paged_kv, assert_close, head_dim, ratio, block_size, dtype
):
    lens = edge_lengths(block_size)
    actual, expected = run_decode(paged_kv, lens, block_size, 2, ratio, head_dim, dtype)
    assert_close(actual, expected)


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(64, torch.float32), (128, torch.float16)], ids=DTYPE_IDS
)
def test_decode_attention_matches_reference_over_split_k_contexts(
    paged_kv, assert_close, head_dim, dtype
):
    # The longest context takes many splits; the short ones leave most of their splits empty.
    lens = [5, 700, 2100]
    assert plan_splits(2112).num_splits > 4
    actual, expected = run_decode(paged_kv, lens, 16, 2, 4, head_dim, dtype)
    assert_close(actual, expected)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_attention_handles_head_dims_that_are_not_powers_of_two_and_int64_metadata(
    paged_kv, assert_close, head_dim
):
    lens, runs, fp16, int64 = [3, 40, 300], [(0, 3), (17, 70)], torch.float16, torch.int64
    actual, expected = run_decode(paged_kv, lens, 16, 2, 4, head_dim, fp16, int64)
    assert_close(actual, expected)
    actual, expected = run_prefill(paged_kv, runs, 16, 2, 4, head_dim, fp16, int64)
    assert_close(actual, expected)


def test_split_plan_grows_with_context_and_caps_the_split_count():
    assert plan_splits(16) == SplitPlan(num_splits=1, tokens_per_split=64)
    assert plan_splits(300) == SplitPlan(num_splits=2, tokens_per_split=192)
    assert plan_splits(4096) == SplitPlan(num_splits=16, tokens_per_split=256)
    assert plan_splits(1 << 20).num_splits == 32


def run_prefill(
    paged_kv, runs, block_size, num_kv_heads, ratio, head_dim, dtype, index_dtype=torch.int32
):
    """`runs` are (cached prefix, new tokens) pairs; pages hold prefix and new K/V alike."""
    kv = paged_kv([p + n for p, n in runs], block_size, num_kv_heads, head_dim, dtype)
    new_lens = torch.tensor([n for _, n in runs])
    cu_seqlens = torch.nn.functional.pad(new_lens.cumsum(0), (1, 0)).to(index_dtype)
    prefix_lens = torch.tensor([p for p, _ in runs], dtype=index_dtype)
    query = torch.randn(int(new_lens.sum()), num_kv_heads * ratio, head_dim).to(dtype)
    tables = kv.block_tables.to(index_dtype)
    args = (query, kv.k_cache, kv.v_cache, cu_seqlens, tables, prefix_lens)
    scale = head_dim**-0.5
    return (
        triton_kernels.prefill_attention(*args, scale),
        reference.prefill_attention(*args, scale),
    )


def prefill_grid() -> list:
    """Every (head dim, ratio, block size), with the dtype alternating so each meets both dtypes.

    The full product doubles the slowest tests under the interpreter for no new pairing.
    """
    cases = []
    for h, head_dim in enumerate(HEAD_DIMS):
        for r, ratio in enumerate(RATIOS):
            for b, block_size in enumerate(BLOCK_SIZES):
                d = (h + r + b) % 2
                case_id = f"d{head_dim}-gqa{ratio}-bs{block_size}-{DTYPE_IDS[d]}"
                cases.append(pytest.param(head_dim, ratio, block_size, DTYPES[d], id=case_id))
    return cases


@pytest.mark.parametrize(("head_dim", "ratio", "block_size", "dtype"), prefill_grid())
def test_prefill_attention_matches_reference_on_ragged_runs_over_paged_prefixes(
    paged_kv, assert_close, head_dim, ratio, block_size, dtype
):
    # New-token counts hit every page edge; prefixes are empty, page-aligned and unaligned.
    news = edge_lengths(block_size)
    runs = list(zip([0, block_size, 0, 37, 5], news, strict=True))
    actual, expected = run_prefill(paged_kv, runs, block_size, 2, ratio, head_dim, dtype)
    assert_close(actual, expected)
