"""The CPU decode attentions (the compiled kernel of `cpu_attention`, the serving path, and the
torch reference) against the plain per-sequence loop: one sequence at a time over exactly its
own pages, nothing padded or masked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isa_testkit import RUNNABLE, variant

from halfmoon.kernels import cpu_attention, cpu_build, ops, reference

DTYPES = (torch.float32, torch.bfloat16)
DTYPE_IDS = ("fp32", "bf16")


def per_sequence_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Each sequence's context gathered on its own, then SDPA with the KV heads repeated."""
    out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    for s, seq_len in enumerate(seq_lens.tolist()):
        pages = block_tables[s, : -(-seq_len // block_size)].long()
        keys = k_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = v_cache[pages].flatten(0, 1)[:seq_len].transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            query[s][:, None], keys, values, scale=scale, enable_gqa=True
        )
        out[s] = attn[:, 0]
    return out


# The CPU implementations: the compiled kernel in each variant this machine runs (it needs g++,
# which every CI machine has), and the torch reference.
KERNELS = (*RUNNABLE, "torch")


@pytest.fixture(params=KERNELS)
def kernel(request):
    if request.param == "torch":
        yield reference
        return
    with variant(request.param, cpu_attention.LIBRARY):
        yield cpu_attention


@pytest.fixture(params=RUNNABLE)
def native(request):
    """The compiled kernel, in each variant this machine runs."""
    with variant(request.param, cpu_attention.LIBRARY):
        yield cpu_attention


def decode_both(kernel, paged_kv, lens, ratio, dtype, num_kv_heads=2, head_dim=64, block_size=16):
    """(the kernel's output, the per-sequence loop's) on the same paged K/V."""
    kv = paged_kv(lens, block_size, num_kv_heads, head_dim, dtype)
    query = torch.randn(len(lens), num_kv_heads * ratio, head_dim).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(lens), head_dim**-0.5)
    return kernel.paged_decode_attention(*args), per_sequence_attention(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ratio", (1, 2, 4, 8))
@pytest.mark.parametrize("num_seqs", (1, 7, 64))
def test_decode_matches_the_per_sequence_loop_over_mixed_contexts(
    kernel, paged_kv, assert_close, num_seqs, ratio, dtype
):
    lens = torch.randint(1, 2049, (num_seqs,), generator=torch.Generator().manual_seed(num_seqs))
    actual, expected = decode_both(kernel, paged_kv, lens.tolist(), ratio, dtype)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", (32, 128))  # the native kernel: any size, and a fixed one
def test_decode_matches_on_page_edges_in_any_order(kernel, paged_kv, assert_close, dtype, head_dim):
    lens = [17, 1, 2048, 16, 15, 300, 32, 2047, 1]  # unsorted, repeated, page edges
    actual, expected = decode_both(kernel, paged_kv, lens, 4, dtype, head_dim=head_dim)
    assert_close(actual, expected)


def test_decode_of_equal_whole_page_contexts_needs_no_mask(kernel, paged_kv, assert_close):
    actual, expected = decode_both(kernel, paged_kv, [64] * 5, 2, torch.float32)
    assert_close(actual, expected)


def test_every_variant_this_cpu_runs_is_tested_best_first():
    assert RUNNABLE[-1] == "generic" and cpu_build.current().name == RUNNABLE[0]


def test_decode_splits_the_batch_into_chunks_without_changing_the_result(
    paged_kv, assert_close, monkeypatch
):
    # 8 KiB of K a chunk at 2 heads x 32 dims x fp32 (256 bytes a token): 32 tokens a chunk,
    # so every sequence longer than a page is a chunk of its own and the short ones pair up.
    monkeypatch.setattr(reference, "DECODE_CHUNK_BYTES", 8192)
    lens = [5, 400, 16, 3, 33, 1, 900, 2]
    chunks = reference._decode_chunks(sorted(lens, reverse=True), 16, 256)
    assert chunks == [
        (0, 1, 912, 900),
        (1, 2, 400, 400),
        (2, 3, 48, 33),
        (3, 5, 16, 5),
        (5, 7, 16, 2),
        (7, 8, 16, 1),
    ]
    actual, expected = decode_both(reference, paged_kv, lens, 2, torch.float32, head_dim=32)
    assert_close(actual, expected)


@pytest.mark.parametrize("num_threads", (2, 3))
def test_native_decode_gives_the_same_bits_on_any_number_of_threads(
    native, paged_kv, assert_close, num_threads
):
    lens = [900, 3, 70, 1, 16]
    kv = paged_kv(lens, 16, 2, 64, torch.bfloat16)
    query = torch.randn(len(lens), 4, 64).to(torch.bfloat16)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(lens), 0.125)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_attention.paged_decode_attention(*args)
        torch.set_num_threads(num_threads)
        shared = cpu_attention.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(shared, alone)  # a sequence is one thread's work, whatever the count
    assert_close(alone, per_sequence_attention(*args))


def test_cpu_decode_dispatches_to_the_native_kernel_unless_torch_is_forced(native, monkeypatch):
    query, cache = torch.zeros(1, 2, 8), torch.zeros(1, 16, 1, 8)
    calls = []
    for module in (cpu_attention, reference):
        monkeypatch.setattr(module, "paged_decode_attention", lambda *a, m=module: calls.append(m))
    ops.paged_decode_attention(query, cache, cache, torch.zeros(1, 1), torch.ones(1), 1.0)
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    ops.paged_decode_attention(query, cache, cache, torch.zeros(1, 1), torch.ones(1), 1.0)
    assert calls == [cpu_attention, reference]


def test_the_native_kernel_refuses_tensors_off_the_cpu(native):
    # It reads raw pointers: a GPU tensor's would crash the process (seen on the first GPU run).
    query, cache = torch.zeros(1, 2, 8, device="meta"), torch.zeros(1, 16, 1, 8, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        cpu_attention.paged_decode_attention(
            query, cache, cache, torch.zeros(1, 1), torch.ones(1), 1.0
        )


def test_decode_ignores_whatever_the_masked_slots_hold(kernel, paged_kv, assert_close):
    # Slots past a sequence's length (its last page's tail, the pages its padded table row
    # names) are read into the padded chunk but masked: nan there must not reach the output.
    lens = [3, 40, 17]
    kv = paged_kv(lens, 16, 2, 32, torch.float32)
    query = torch.randn(3, 4, 32)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor(lens), 0.2)
    expected = per_sequence_attention(*args)
    owned = [kv.block_tables[row, : -(-n // 16)].tolist() for row, n in enumerate(lens)]
    for cache in (kv.k_cache, kv.v_cache):
        cache[[p for p in range(len(cache)) if all(p not in pages for pages in owned)]] = torch.nan
        for pages, length in zip(owned, lens, strict=True):
            cache[pages[-1], (length - 1) % 16 + 1 :] = torch.nan
    assert_close(kernel.paged_decode_attention(*args), expected)


def per_run_prefill(query, k_cache, v_cache, cu_seqlens_q, block_tables, prefix_lens, scale):
    """Each run over its prefix and itself with an explicit bottom-right causal mask."""
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for s, prefix_len in enumerate(prefix_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        total = prefix_len + end - start
        pages = block_tables[s, : -(-total // k_cache.shape[1])].long()
        keys = k_cache[pages].flatten(0, 1)[:total].transpose(0, 1)
        values = v_cache[pages].flatten(0, 1)[:total].transpose(0, 1)
        mask = torch.arange(total)[None, :] <= torch.arange(prefix_len, total)[:, None]
        attn = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1),
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_with_and_without_prefixes_matches_the_masked_loop(paged_kv, assert_close, dtype):
    runs = [(0, 300), (37, 5), (0, 1), (16, 17), (0, 64)]  # (cached prefix, new tokens)
    kv = paged_kv([p + n for p, n in runs], 16, 2, 64, dtype)
    cu_seqlens = torch.tensor([0, *[n for _, n in runs]]).cumsum(0)
    prefix_lens = torch.tensor([p for p, _ in runs])
    query = torch.randn(int(cu_seqlens[-1]), 8, 64).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, cu_seqlens, kv.block_tables, prefix_lens, 0.125)
    assert_close(reference.prefill_attention(*args), per_run_prefill(*args))
