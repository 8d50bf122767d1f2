"""The AMX prefill attention of `cpu_prefill` against the torch reference: ragged bf16 runs
over their pages, with and without a cached prefix; its place in the dispatch; and the AMX
tile state it borrows from a thread left as oneDNN and torch expect it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_testkit import RUNNABLE, variant

from halfmoon.engine import cpu_linear
from halfmoon.kernels import cpu_prefill, ops, reference
from halfmoon.kernels.attention import AttentionMetadata, paged_attention


@pytest.fixture(autouse=True)
def amx():
    """The `amx` variant, where this CPU has AMX and Linux lends it to this process."""
    if "amx" not in RUNNABLE:
        pytest.skip("this CPU has no AMX: the torch reference serves prefill attention")
    with variant("amx", cpu_prefill.LIBRARY):
        if not cpu_prefill.available():
            pytest.skip("Linux did not lend this process the AMX tiles (arch_prctl refused)")
        yield


def runs_over_pages(paged_kv, lens, prefixes, ratio, block_size=16, num_kv_heads=2):
    """bf16 queries for runs of `lens` new tokens after `prefixes` cached ones, and the paged
    K/V holding both; the arguments `prefill_attention` takes, scale 1/8."""
    kv = paged_kv(
        [n + p for n, p in zip(lens, prefixes, strict=True)],
        block_size,
        num_kv_heads,
        64,
        torch.bfloat16,
    )
    query = torch.randn(sum(lens), num_kv_heads * ratio, 64).to(torch.bfloat16)
    cu_seqlens = torch.tensor([0, *lens]).cumsum(0).int()
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    return query, kv.k_cache, kv.v_cache, cu_seqlens, kv.block_tables, prefix_lens, 0.125


@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
@pytest.mark.parametrize("block_size", (16, 32))
def test_runs_with_and_without_a_prefix_match_the_reference(
    paged_kv, assert_close, ratio, block_size
):
    lens = [1, 15, 16, 17, 33, 300, 2]  # tile edges: 16 queries, 32-token blocks
    prefixes = [0, 5, 0, 40, 16, 700, 31]
    args = runs_over_pages(paged_kv, lens, prefixes, ratio, block_size)
    assert cpu_prefill.supports(*args[:3])
    assert_close(cpu_prefill.prefill_attention(*args), reference.prefill_attention(*args))


def test_a_run_longer_than_a_step_matches_the_reference(paged_kv, assert_close):
    args = runs_over_pages(paged_kv, [2048], [1500], ratio=2)
    assert_close(cpu_prefill.prefill_attention(*args), reference.prefill_attention(*args))


def test_threads_share_the_work_without_changing_a_bit(paged_kv):
    args = runs_over_pages(paged_kv, [300, 17, 64, 1, 129], [0, 100, 0, 9, 0], ratio=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_prefill.prefill_attention(*args)
        torch.set_num_threads(2)
        two = cpu_prefill.prefill_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each query block is one thread's, start to end


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size"),
    [(torch.float32, 64, 16), (torch.bfloat16, 128, 16), (torch.bfloat16, 64, 8)],
    ids=["fp32", "head-128", "pages-of-8"],
)
def test_other_shapes_go_to_the_reference(paged_kv, dtype, head_dim, block_size):
    kv = paged_kv([40], block_size, 2, head_dim, dtype)
    query = torch.randn(40, 4, head_dim).to(dtype)
    assert not cpu_prefill.supports(query, kv.k_cache, kv.v_cache)
    assert not ops.native_prefill(query, kv.k_cache, kv.v_cache)


def test_the_forced_torch_backend_keeps_the_reference(paged_kv, monkeypatch):
    query, k_cache, v_cache, *_ = runs_over_pages(paged_kv, [20], [0], ratio=2)
    assert ops.native_prefill(query, k_cache, v_cache)
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    assert not ops.native_prefill(query, k_cache, v_cache)


def test_runs_with_no_prefix_read_the_pages_where_the_kernel_serves(
    paged_kv, assert_close, monkeypatch
):
    """The dense lengths a step carries are not taken: the kernel reads the pages instead."""
    calls = []
    kernel = cpu_prefill.prefill_attention
    monkeypatch.setattr(cpu_prefill, "prefill_attention", lambda *a: calls.append(1) or kernel(*a))
    lens = [40, 7]
    query, k_cache, v_cache, cu_seqlens, tables, prefix_lens, scale = runs_over_pages(
        paged_kv, lens, [0, 0], ratio=2
    )
    key = torch.randn(sum(lens), 2, 64).to(torch.bfloat16)
    value = torch.randn(sum(lens), 2, 64).to(torch.bfloat16)
    slots = [int(tables[r, t // 16]) * 16 + t % 16 for r, n in enumerate(lens) for t in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_prefill_tokens=sum(lens),
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_block_tables=tables,
        prefill_prefix_lens=prefix_lens,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        prefill_dense_lens=lens,
    )
    out = paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    assert calls == [1]
    assert_close(out, reference.causal_attention(query, key, value, lens, scale))


def test_onednn_and_torch_attention_still_run_on_amx_after_it(paged_kv):
    """The kernel loads its own tile configuration on each thread and puts the thread's back:
    oneDNN's bf16 GEMMs and torch's fused attention (both on AMX) give the same bits after."""
    torch.manual_seed(1)
    linear = cpu_linear.PackedLinear(torch.nn.Linear(512, 256, bias=False, dtype=torch.bfloat16))
    x = torch.randn(300, 512).to(torch.bfloat16)
    q, k, v = (torch.randn(1, 4, 256, 64).to(torch.bfloat16) for _ in range(3))
    threads = torch.get_num_threads()
    with torch.inference_mode():
        before = linear(x), F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            for count in (1, 2):
                torch.set_num_threads(count)
                cpu_prefill.prefill_attention(*runs_over_pages(paged_kv, [100], [20], ratio=2))
        finally:
            torch.set_num_threads(threads)
        after = linear(x), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
