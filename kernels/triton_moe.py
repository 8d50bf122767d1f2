"""Triton fused MoE: `moe.fused_moe` as two grouped GEMMs over blocks of one expert's rows.

The (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of
`block_m` (`align_block_size`), so every block of rows belongs to one expert. One program
multiplies one block by a tile of its expert's weight columns: first `x` by `w_gate_up` with
SwiGLU fused (one row per pair), then those rows by `w_down` with the routing weight
multiplied in; the k slots of each token are summed in torch. Sorting and padding stay on the
device with no host sync, so the grid is sized for the most blocks any routing can need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from halfmoon.kernels.triton_paged import dot_precision


@triton.jit
def _expert_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    n,
    kdim,
    stride_we,
    stride_wn,
    stride_wk,
    PAIRS_PER_A_ROW: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:  # a block past the last expert's: the grid is sized for the worst routing
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = pairs < num_pairs  # the padding of the expert's run holds `num_pairs`
    a_rows = a_ptr + (pairs // PAIRS_PER_A_ROW)[:, None] * kdim
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_cols = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_cols = gate_cols + n * stride_wn  # the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, kdim, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=rows[:, None] & (ks[None, :] < kdim), other=0.0)
        w_mask = (ks[:, None] < kdim) & (cols[None, :] < n)
        w = tl.load(gate_cols + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(up_cols + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
            up_acc = tl.dot(a, up, up_acc, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * up_acc
    else:  # the down projection: scaled by the pair's routing weight
        acc = acc * tl.load(weights_ptr + pairs, mask=rows, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * n + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & (cols[None, :] < n))


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`moe.fused_moe_reference` on the GPU (shapes checked there; ids are not range-checked,
    which would sync: an id outside [0, E) is a device-side error)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    blocks = expert_blocks(topk_ids, w_gate_up.shape[0])
    act = torch.empty(topk_ids.numel(), w_down.shape[2], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _expert_gemm(x.contiguous(), w_gate_up, act, weights, blocks, top_k, gated=True)
    pair_out = torch.empty(topk_ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    _expert_gemm(act, w_down, pair_out, weights, blocks, 1, gated=False)
    return pair_out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def expert_blocks(topk_ids: torch.Tensor, num_experts: int) -> tuple:
    """(pair ids, block experts, block_m): `align_block_size` at `rows_per_block` rows."""
    block_m = rows_per_block(topk_ids.numel(), num_experts)
    return *align_block_size(topk_ids, num_experts, block_m), block_m


def _expert_gemm(a, w, out, weights, blocks, pairs_per_a_row: int, gated: bool) -> None:
    """`out[pair] = a[pair // pairs_per_a_row] @ w[expert].T` per block of one expert's pairs:
    SwiGLU of the gate and up halves when `gated`, else scaled by the pair's routing weight."""
    pair_ids, block_experts, block_m = blocks
    n, kdim = out.shape[1], a.shape[1]
    block_n, block_k = _tile(n), _tile(kdim)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    pointers = (a, w, out, weights, pair_ids, block_experts)
    _expert_gemm_kernel[grid](
        *pointers,
        out.shape[0],
        n,
        kdim,
        *w.stride(),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATED=gated,
        DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _tile(size: int) -> int:
    """A column or reduction tile: a power of two that `tl.dot` takes, 16 to 64 (lanes past
    `size` are masked)."""
    return min(64, max(16, triton.next_power_of_2(size)))


def rows_per_block(num_pairs: int, num_experts: int) -> int:
    """`block_m`: about the rows an expert gets on average (16 to 64), so decode's few rows per
    expert waste little padding and prefill's many share each weight tile widely."""
    return min(64, max(16, triton.next_power_of_2(-(-num_pairs // num_experts))))


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids, block experts): the flat pair indices `token * k + slot` sorted by expert,
    each expert's run padded with `num_pairs` to a multiple of `block_m`; and each block's
    expert, -1 for the blocks past the last run (sized for the worst routing, without a sync)."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = -(-counts // block_m) * block_m
    num_blocks = (flat.numel() + min(num_experts, flat.numel()) * (block_m - 1)) // block_m
    pair_ids = _sorted_runs(flat, counts, padded, num_blocks * block_m)
    return pair_ids, _block_experts(padded, num_blocks, block_m)


def _sorted_runs(flat, counts, padded, size: int) -> torch.Tensor:
    """`size` int32 slots: each pair index at its rank within its expert's run, the runs
    `padded[e]` long one after another, the rest `flat.numel()`."""
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    ranks = torch.arange(flat.numel(), device=flat.device) - _starts(counts)[experts]
    pair_ids = torch.full((size,), flat.numel(), dtype=torch.int32, device=flat.device)
    pair_ids[_starts(padded)[experts] + ranks] = order.int()
    return pair_ids


def _block_experts(padded, num_blocks: int, block_m: int) -> torch.Tensor:
    """The expert whose padded run holds each of `num_blocks` blocks; -1 past the last run."""
    block_starts = torch.arange(num_blocks, device=padded.device) * block_m
    experts = torch.searchsorted(torch.cumsum(padded, dim=0), block_starts, right=True)
    return torch.where(experts < padded.numel(), experts, -1).int()


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """Where each of consecutive runs of `sizes` begins (the exclusive prefix sum)."""
    return torch.cumsum(sizes, dim=0) - sizes
