"""A mixture-of-experts layer: per token, a router picks k of E expert MLPs and sums their
outputs with its weights, computed as transformers computes them for Mixtral, Qwen2-MoE and
Qwen3-MoE (softmax in fp32, top-k, optionally renormalised over the k).

The experts run grouped (`kernels/moe.py`: each expert one GEMM over the tokens routed to it;
on CUDA the Triton kernel). Under tensor parallelism each expert's MLP is split as a dense MLP
is (its gate and up rows column-, its down columns row-parallel), the router and the shared
expert's gate are whole on every rank, and one all-reduce sums the routed and the shared
experts' partial outputs."""

from __future__ import annotations

import torch
from torch import nn

from halfmoon.engine import cpu_linear
from halfmoon.engine.mlp import MLP
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.tensor_parallel import TPGroup
from halfmoon.kernels import moe, ops


class Experts(nn.Module):
    """E SwiGLU MLPs as two stacked weights, transformers 5's layout: `gate_up_proj`
    `[E, 2 * I, H]` (each expert's gate rows, then its up rows) and `down_proj` `[E, H, I]`,
    `I` being this rank's slice of an expert's intermediate size.

    On CUDA one fused call runs them all (`moe.fused_moe`, Triton). On CPU, once loaded,
    `pack_for_cpu` gives each expert its two GEMMs as the dense layers' `PackedLinear`s
    (cpu_gemm's tiles or oneDNN's prepacked weight, per dtype and CPU: engine/cpu_linear.py), and
    each expert runs them over the tokens routed to it (`moe.grouped_moe`); with
    `group_tokens` False, once per (token, slot) instead (`moe.per_token_moe`: what grouping
    replaced, for `bench engine --vs-expert-loop` to measure)."""

    group_tokens = True

    def __init__(self, num_experts: int, hidden_size: int, size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        self.packed: list[tuple[nn.Module, nn.Module]] | None = None

    def pack_for_cpu(self) -> None:
        """Each expert's gate_up and down GEMMs as CPU linear layers over views of the stacked
        weights (which stay: the packed layouts are copies, as a dense layer's are)."""
        self.packed = [
            (_packed(gate_up), _packed(down))
            for gate_up, down in zip(self.gate_up_proj, self.down_proj, strict=True)
        ]

    def forward(self, x, topk_ids, topk_weights) -> torch.Tensor:
        if self.packed is None:
            return moe.fused_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        num_experts = self.gate_up_proj.shape[0]
        moe.check_shapes(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        if not self.group_tokens:
            return moe.per_token_moe(x, topk_ids, topk_weights, self._expert)
        return moe.grouped_moe(x, topk_ids, topk_weights, num_experts, self._expert)

    def _expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.packed[index]
        return down(ops.silu_and_mul(gate_up(rows)))


def _packed(weight: torch.Tensor) -> nn.Module:
    """`weight` ([N, K]) as the CPU's best linear layer for it, or a plain one."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return cpu_linear.PackedLinear(linear) if cpu_linear.packable(linear) else linear


def pack_experts(model: nn.Module) -> int:
    """`pack_for_cpu` every CPU `Experts` of `model` (after its weights are loaded); how many."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    experts = [m for m in experts if m.gate_up_proj.device.type == "cpu"]
    for each in experts:
        each.pack_for_cpu()
    return len(experts)


class SparseMoeBlock(nn.Module):
    """The layer's MLP when it has experts (`cfg.moe`)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        shape = cfg.moe
        self.group, self.shape = group, shape
        self.gate = nn.Linear(cfg.hidden_size, shape.num_experts, bias=False)
        size = shape.expert_intermediate_size // group.size
        self.experts = Experts(shape.num_experts, cfg.hidden_size, size)
        self.shared_expert = self.shared_expert_gate = None
        if shape.shared_expert_intermediate_size:
            shared = shape.shared_expert_intermediate_size // group.size
            self.shared_expert = MLP(cfg.hidden_size, shared, group)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert.partial(x)
        return self.group.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each `[T, k]`: the top k of the router's softmax."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.shape.top_k, dim=-1)
        if self.shape.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.shape.round_weights else weights), ids
