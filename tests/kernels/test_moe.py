"""The mixture-of-experts MLP: the grouped torch reference and the Triton grouped GEMM (under the
interpreter on CPU) against the per-token loop, and the dispatch between them."""

from __future__ import annotations

import pytest
import torch

from halfmoon.kernels import moe, triton_moe


def make_moe(num_tokens, num_experts, top_k, hidden=32, inter=32, dtype=torch.float32):
    """Random inputs of `moe.fused_moe`: weights scaled so outputs stay near 1."""
    torch.manual_seed(0)
    x = torch.randn(num_tokens, hidden).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter) / inter**0.5).to(dtype)
    scores = torch.randn(num_tokens, num_experts).softmax(dim=-1)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    return x, w_gate_up, w_down, topk_ids, topk_weights


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2)])
def test_grouped_reference_matches_the_per_token_loop(assert_close, num_tokens, num_experts, top_k):
    inputs = make_moe(num_tokens, num_experts, top_k)
    assert_close(moe.fused_moe_reference(*inputs), moe.moe_per_token_loop(*inputs))


def test_reference_adds_duplicate_ids_and_skips_experts_without_tokens(assert_close):
    x, w_gate_up, w_down, _, _ = make_moe(3, 4, 2)
    topk_ids = torch.tensor([[1, 1], [1, 3], [3, 1]])
    topk_weights = torch.tensor([[0.25, 0.5], [1.0, 2.0], [0.5, 0.5]])
    out = moe.fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)
    expert = [moe.expert_mlp(x, w_gate_up[e], w_down[e]) for e in range(4)]
    expected = torch.stack(
        [0.75 * expert[1][0], expert[1][1] + 2 * expert[3][1], 0.5 * (expert[3][2] + expert[1][2])]
    )
    assert_close(out, expected)


def test_reference_of_no_tokens_is_empty_in_the_input_dtype():
    x, w_gate_up, w_down, topk_ids, topk_weights = make_moe(0, 4, 2, dtype=torch.bfloat16)
    out = moe.fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_reference_takes_int32_ids_and_keeps_bf16(assert_close):
    x, w_gate_up, w_down, topk_ids, topk_weights = make_moe(5, 4, 2, dtype=torch.bfloat16)
    out = moe.fused_moe_reference(x, w_gate_up, w_down, topk_ids.int(), topk_weights)
    assert_close(out, moe.moe_per_token_loop(x, w_gate_up, w_down, topk_ids, topk_weights))


@pytest.mark.parametrize(
    "field,shape,message",
    [
        ("x", (5, 16), "w_gate_up"),
        ("w_gate_up", (4, 63, 32), "w_gate_up"),
        ("w_down", (4, 32, 16), "w_down"),
        ("topk_ids", (4, 2), "topk_ids"),
        ("topk_weights", (5, 1), "topk_weights"),
    ],
)
def test_mismatched_shapes_raise_value_errors_naming_the_input(field, shape, message):
    names = ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights")
    inputs = dict(zip(names, make_moe(5, 4, 2), strict=True))
    inputs[field] = torch.zeros(shape, dtype=inputs[field].dtype)
    with pytest.raises(ValueError, match=message):
        moe.fused_moe(**inputs)


def test_weights_in_another_dtype_raise_value_error():
    x, w_gate_up, w_down, topk_ids, topk_weights = make_moe(5, 4, 2)
    with pytest.raises(ValueError, match="x's dtype"):
        moe.fused_moe(x, w_gate_up.half(), w_down, topk_ids, topk_weights)


def test_expert_ids_out_of_range_raise_value_error():
    x, w_gate_up, w_down, topk_ids, topk_weights = make_moe(5, 4, 2)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        moe.fused_moe(x, w_gate_up, w_down, topk_ids + 3, topk_weights)


def test_dispatch_takes_the_reference_for_cpu_tensors(monkeypatch):
    monkeypatch.delenv("HALFMOON_KERNELS", raising=False)
    inputs = [tensor.cpu() for tensor in make_moe(5, 4, 2)]
    calls = []
    monkeypatch.setattr(moe, "fused_moe_reference", lambda *args: calls.append(args) or args[0])
    moe.fused_moe(*inputs)
    assert len(calls) == 1


def test_align_block_size_pads_each_experts_run_and_marks_spare_blocks():
    topk_ids = torch.tensor([[2, 0], [2, 2]])
    pair_ids, block_experts = triton_moe.align_block_size(topk_ids, 3, 2)
    # Expert 0 holds pair 1, padded with 4 (the pair count); expert 1 none; expert 2 pairs 0, 2, 3.
    assert pair_ids.tolist() == [1, 4, 0, 2, 3, 4]
    assert block_experts.tolist() == [0, 2, 2]
    _, spare = triton_moe.align_block_size(torch.tensor([[1], [1], [1]]), 4, 2)
    assert spare.tolist() == [1, 1, -1]


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2)])
@pytest.mark.parametrize("hidden,inter", [(32, 64), (64, 32)])
def test_triton_moe_matches_the_reference(
    assert_close, num_tokens, num_experts, top_k, hidden, inter
):
    inputs = make_moe(num_tokens, num_experts, top_k, hidden, inter)
    assert_close(triton_moe.fused_moe(*inputs), moe.fused_moe_reference(*inputs))


def test_triton_moe_masks_ragged_tiles_and_tall_blocks(assert_close):
    # 66 pairs over 4 experts take 32-row blocks; 80 and 96 leave part of a 64-wide tile.
    inputs = make_moe(33, 4, 2, hidden=96, inter=80)
    assert triton_moe.rows_per_block(66, 4) == 32
    assert_close(triton_moe.fused_moe(*inputs), moe.fused_moe_reference(*inputs))


def test_triton_moe_adds_duplicate_ids_and_takes_int32_ids(assert_close):
    x, w_gate_up, w_down, _, topk_weights = make_moe(3, 4, 2)
    topk_ids = torch.tensor([[1, 1], [1, 3], [3, 1]], dtype=torch.int32)
    expected = moe.moe_per_token_loop(x, w_gate_up, w_down, topk_ids, topk_weights)
    assert_close(triton_moe.fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights), expected)


def test_triton_moe_reads_strided_weights(assert_close):
    x, w_gate_up, w_down, topk_ids, topk_weights = make_moe(5, 4, 2)
    column_major = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gate_up, w_down)]
    out = triton_moe.fused_moe(x, *column_major, topk_ids, topk_weights)
    assert_close(out, moe.fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights))


def test_triton_moe_keeps_fp16_and_returns_empty_for_no_tokens(assert_close):
    inputs = make_moe(5, 4, 2, dtype=torch.float16)
    assert_close(triton_moe.fused_moe(*inputs), moe.fused_moe_reference(*inputs))
    empty = triton_moe.fused_moe(*make_moe(0, 4, 2, dtype=torch.float16))
    assert empty.shape == (0, 32) and empty.dtype == torch.float16


@pytest.mark.parametrize("forced,expected", [("triton", "triton_moe"), ("torch", "reference")])
def test_dispatch_follows_the_forced_backend(monkeypatch, forced, expected):
    monkeypatch.setenv("HALFMOON_KERNELS", forced)
    calls = []
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *args: calls.append("triton_moe"))
    monkeypatch.setattr(moe, "fused_moe_reference", lambda *args: calls.append("reference"))
    moe.fused_moe(*make_moe(5, 4, 2))
    assert calls == [expected]
