"""The experts of a mixture-of-experts checkpoint, read from its config as transformers reads
them (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

from dataclasses import dataclass

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class MoeShape:
    """Per token, a router picks `top_k` of `num_experts` SwiGLU MLPs of
    `expert_intermediate_size` and sums their outputs with its softmax weights (renormalised
    over the k picked when `norm_topk_prob`). Qwen2-MoE adds a shared expert of
    `shared_expert_intermediate_size` (0: none) scaled by a sigmoid gate. Only the layers in
    `sparse_layers` have experts; the others a dense MLP of the model's intermediate size.
    `round_weights`: the routing weights are rounded to the model's dtype before use (Qwen), or
    kept in fp32 (Mixtral)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    sparse_layers: tuple[int, ...]
    round_weights: bool


def moe_shape(architecture: str, hf: dict) -> MoeShape | None:
    """The experts of a config (`hf`: config.json over the architecture's defaults); None for a
    dense architecture."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_layers = int(hf["num_hidden_layers"])
    # transformers maps `num_experts` to `num_local_experts` on Mixtral and Qwen3-MoE (which
    # it saves under the latter); Qwen2-MoE and the Qwen checkpoints on the hub write the former.
    num_experts = int(hf.get("num_local_experts") or hf["num_experts"])
    top_k = int(hf["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {num_experts}]")
    if architecture == "MixtralForCausalLM":
        return MoeShape(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=0,
            sparse_layers=tuple(range(num_layers)),
            round_weights=False,
        )
    dense = set(hf.get("mlp_only_layers") or [])
    step = int(hf["decoder_sparse_step"])
    shared = hf.get("shared_expert_intermediate_size", 0)
    return MoeShape(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        shared_expert_intermediate_size=int(shared or 0),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        round_weights=True,
    )
