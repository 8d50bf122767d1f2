"""Mixture-of-experts MLPs: each token's hidden state through its top-k experts' SwiGLU MLPs,
summed with its routing weights.

`fused_moe` is the entry point: CUDA tensors run the Triton grouped GEMM (`triton_moe`),
others the torch reference, which groups tokens by expert so each expert runs one gate_up
and one down GEMM over its tokens. `moe_per_token_loop` is the naive loop it replaces, kept
for the benchmark that measures grouping and as the tests' oracle.

Weights: `w_gate_up` is `[E, 2 * I, H]` (per expert, the gate rows then the up rows, like a
dense MLP's `gate_up_proj.weight`) and `w_down` is `[E, H, I]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from halfmoon.kernels import ops, reference


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`[T, H]` in x's dtype: per token t, the sum over j of `topk_weights[t, j]` times expert
    `topk_ids[t, j]`'s MLP of `x[t]`."""
    check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)
    if ops.backend_for(x) is reference:
        return fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)
    from halfmoon.kernels import triton_moe

    return triton_moe.fused_moe(x, w_gate_up, w_down, topk_ids, topk_weights)


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe` in torch: the (token, slot) pairs sorted by expert once, then per expert
    with tokens one gate_up GEMM, SwiGLU, one down GEMM, scaled and added into fp32 rows."""
    check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_mlp(rows, w_gate_up[index], w_down[index])

    return grouped_moe(x, topk_ids, topk_weights, w_gate_up.shape[0], expert)


def grouped_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed sum with each expert's MLP given as `expert(index, rows)`, called once per
    expert that has tokens, over all of them (the engine's CPU path passes its packed linear
    layers, engine/moe_block.py). The rows are gathered in expert order once, each expert
    takes its run of them, and one weighted add sums the k slots of each token: an expert
    costs its two GEMMs and SwiGLU, not a gather and a scatter of its own."""
    order, counts = expert_order(topk_ids, num_experts)
    tokens = order // topk_ids.shape[1]
    runs = x.index_select(0, tokens).split(counts)
    outputs = [expert(index, rows) for index, rows in enumerate(runs) if rows.shape[0]]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if outputs:
        weights = topk_weights.reshape(-1)[order].float()[:, None]
        out.index_add_(0, tokens, torch.cat(outputs).float() * weights)
    return out.to(x.dtype)


def moe_per_token_loop(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe` as a loop over tokens and their slots: one expert MLP per (token, slot)."""
    check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        return expert_mlp(rows, w_gate_up[index], w_down[index])

    return per_token_moe(x, topk_ids, topk_weights, expert)


def per_token_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`grouped_moe` without the grouping: `expert(index, row)` once per (token, slot)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token, (ids, weights) in enumerate(
        zip(topk_ids.tolist(), topk_weights.tolist(), strict=True)
    ):
        for index, weight in zip(ids, weights, strict=True):
            out[token] += weight * expert(index, x[token : token + 1])[0].float()
    return out.to(x.dtype)


def expert_mlp(rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over `rows` ([N, H]) in their dtype."""
    return ops.silu_and_mul(rows @ w_gate_up.t()) @ w_down.t()


def expert_order(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The flat pair indices `token * k + slot` sorted by expert (stably), and how many pairs
    each expert has."""
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < num_experts:
        raise ValueError(f"topk_ids must lie in [0, {num_experts}): got {flat.unique().tolist()}")
    counts = torch.bincount(flat, minlength=num_experts)
    return torch.argsort(flat, stable=True), counts.tolist()


def check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights) -> None:
    """Raise ValueError naming the first input whose shape (or dtype) disagrees with the others."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"expected x [T, H], w_gate_up [E, 2*I, H], w_down [E, H, I]: got x "
            f"{list(x.shape)}, w_gate_up {list(w_gate_up.shape)}, w_down {list(w_down.shape)}"
        )
    num_experts, double_i, hidden = w_gate_up.shape
    if hidden != x.shape[1] or double_i % 2:
        raise ValueError(f"w_gate_up {list(w_gate_up.shape)} is not [E, 2*I, H={x.shape[1]}]")
    if tuple(w_down.shape) != (num_experts, hidden, double_i // 2):
        expected = [num_experts, hidden, double_i // 2]
        raise ValueError(f"w_down {list(w_down.shape)} is not [E, H, I] = {expected}")
    _check_routing(x, topk_ids, topk_weights)
    _check_dtypes(x, w_gate_up, w_down)


def _check_dtypes(x, w_gate_up, w_down) -> None:
    """The GEMMs multiply the weights in x's dtype: cast them once at load, not per call."""
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(
            f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must be in x's dtype {x.dtype}"
        )


def _check_routing(x, topk_ids, topk_weights) -> None:
    """`topk_ids` and `topk_weights` are both `[T, k]`, with integer ids."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} is not [T={x.shape[0]}, k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {list(topk_weights.shape)} differs from topk_ids {list(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be int64 or int32: got {topk_ids.dtype}")
