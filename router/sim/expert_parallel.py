"""What expert parallelism across nodes would change, on paper (docs/moe.md): the routed
experts spread over `ep_degree` GPUs with attention data-parallel, as DeepSeek serves V3.

`python -m halfmoon.router.sim.expert_parallel` prints the figures docs/moe.md quotes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from halfmoon.router.sim.moe_profile import H200, Efficiency, Experts, Gpu, hbm_bytes_per_s

# DeepSeek-V3's routed experts (technical report, arXiv 2412.19437): 58 of its 61 layers are MoE,
# 256 routed experts of width 2048 (plus 1 shared) over hidden 7168, top-8. Its attention is MLA,
# which this shape does not describe, so it feeds only the expert-parallel figures.
DEEPSEEK_V3_EXPERTS = Experts(58, 7168, 2048, count=256, per_token=8)
# H800 SXM, DeepSeek's: the H100 SXM's 989 TFLOP/s and 3.35 TB/s (80 GB), one CX7 400 Gb/s NIC
# (~50 GB/s) per GPU as DeepEP's README tests it.
H800 = Gpu("h800", 9.89e14, 3.35e12, 8.0e10, 5.0e10, 5.0e10, 2.0e11)
# DeepSeek's published layouts: prefill EP32 (4 nodes); decode EP144 (18 nodes) at
# ~90 sequences a GPU (14.8k output tokens/s per node at 20-22 tokens/s each: DeepSeek-V3/R1
# Inference System Overview, 2025-03-01).
DEEPSEEK_LAYOUTS = ((32, 128), (144, 90))


@dataclass(frozen=True, slots=True)
class ExpertParallel:
    """One decode step with the routed experts spread over `ep_degree` GPUs, `batch_per_gpu`
    tokens each (attention data-parallel, experts split evenly: DeepSeek's layout)."""

    experts: Experts
    gpu: Gpu
    ep_degree: int
    batch_per_gpu: int
    bytes_per_param: float = 1.0  # DeepSeek-V3 serves FP8 weights
    dispatch_bytes: float = 1.0  # FP8 dispatch and BF16 combine, as DeepEP
    combine_bytes: float = 2.0
    gpus_per_node: int = 8
    eff: Efficiency = field(default_factory=Efficiency)

    def tokens_per_expert(self) -> float:
        return self.experts.tokens_per_expert(self.batch_per_gpu * self.ep_degree)

    def all_to_all_s(self) -> float:
        """Dispatch and combine over every MoE layer of the share of a token's k experts on
        other nodes, on the GPU's NIC (NVLink within the node is left out)."""
        remote = max(0.0, 1 - self.gpus_per_node / self.ep_degree)
        per_token = self.experts.per_token * self.experts.hidden * remote
        per_layer = self.batch_per_gpu * per_token * (self.dispatch_bytes + self.combine_bytes)
        nic = self.gpu.nic_bytes_per_s * self.eff.network_efficiency
        return self.experts.num_layers * per_layer / nic

    def expert_read_s(self) -> float:
        """Reading the GPU's own experts of every MoE layer once."""
        local = -(-self.experts.count // self.ep_degree)
        weights = self.experts.num_layers * local * self.experts.params * self.bytes_per_param
        return weights / hbm_bytes_per_s(self.gpu, self.eff)


def compute_bound_tokens_per_expert(gpu: Gpu) -> float:
    """Tokens an expert's GEMM needs before compute, not its weight read, bounds it: the GPU's
    FLOPs per HBM byte (at bf16, 2 FLOPs per 2-byte weight per token; FP8 halves the bytes and
    doubles the peak, the same count)."""
    return gpu.peak_flops / gpu.hbm_bytes_per_s


def ep_text(experts: Experts, gpu: Gpu, name: str, layouts: tuple[tuple[int, int], ...]) -> str:
    """Expert-parallel figures of `experts` for each (degree, tokens per GPU) of `layouts`."""
    needed = compute_bound_tokens_per_expert(gpu)
    lines = [
        f"{name} on {gpu.name}: compute-bound from {needed:.0f} tokens per expert, a step of "
        f"{needed * experts.count / experts.per_token:.0f} tokens over the EP group"
    ]
    for degree, batch in layouts:
        ep = ExpertParallel(experts, gpu, degree, batch)
        lines.append(
            f"  EP{degree} x {batch} tokens/GPU: {ep.tokens_per_expert():.0f} tokens/expert, "
            f"expert read {ep.expert_read_s() * 1e3:.1f} ms, cross-node all-to-all "
            f"{ep.all_to_all_s() * 1e3:.1f} ms a step"
        )
    return "\n".join(lines)


def main() -> int:
    """Print DeepSeek-V3's figures in its published layouts and on one 8 x H200 node."""
    print(ep_text(DEEPSEEK_V3_EXPERTS, H800, "deepseek-v3", DEEPSEEK_LAYOUTS))
    print(ep_text(DEEPSEEK_V3_EXPERTS, H200, "deepseek-v3", ((8, 64),)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
