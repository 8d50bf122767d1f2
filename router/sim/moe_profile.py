"""A cost-model profile of a mixture-of-experts model, derived on paper from the model's published
shape and one GPU's published figures (docs/moe.md).

Prefill computes with the active parameters only: 2 FLOPs per active non-embedding parameter a
token, plus attention's 4 x layers x query width a pair of tokens, at `prefill_mfu` of the GPU's
peak; a step reads every weight once, which is its constant. A decode step reads the weights
every token needs (attention, router, LM head) once, and of each layer's E routed experts those
its batch touches: B tokens each picking k of E uniformly touch E (1 - (1 - k/E)^B) in
expectation, so the step grows with the batch sublinearly until every expert is read. A dense
model is the case E = k = 1. The cost model's decode step is linear in the batch
(router/cost_model.py), so a profile carries the least-squares fit (relative error) of that
curve over the batch sizes its decode KV holds at `fit_context_tokens`; `decode_step_s` is the
curve itself.

`python -m halfmoon.router.sim.moe_profile --shape qwen3-30b-a3b --out FILE` writes a profile;
without `--out` it prints the curve and the fit docs/moe.md quotes (router/sim/expert_parallel.py
the expert-parallel figures).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from halfmoon.router.cost_model import CostModel, fit_decode
from halfmoon.router.profile import PROFILE_DIR, Profile, profile_to_dict

MOE_PROFILE = PROFILE_DIR / "qwen3-30b-a3b-1xh200.yaml"


@dataclass(frozen=True, slots=True)
class Experts:
    """The feed-forward experts of each layer; a dense FFN is one expert every token picks."""

    num_layers: int
    hidden: int
    intermediate: int  # config.json's moe_intermediate_size (intermediate_size when dense)
    count: int = 1  # num_experts
    per_token: int = 1  # num_experts_per_tok

    @property
    def params(self) -> int:
        """One expert of one layer: its gate, up and down projections."""
        return 3 * self.hidden * self.intermediate

    def distinct(self, batch: float) -> float:
        """Experts one layer reads for `batch` tokens, in expectation: E (1 - (1 - k/E)^B)."""
        return self.count * (1 - (1 - self.per_token / self.count) ** batch)

    def tokens_per_expert(self, batch: float) -> float:
        """Tokens each expert computes, on average, for `batch` tokens: B k / E."""
        return batch * self.per_token / self.count


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's published shape, as its Hugging Face config.json gives it."""

    name: str
    experts: Experts
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_value: float = 2.0

    @property
    def num_layers(self) -> int:
        return self.experts.num_layers

    def shared_params(self) -> int:
        """Weights every token reads: attention and router of each layer, and the LM head."""
        hidden, heads = self.experts.hidden, self.num_q_heads + self.num_kv_heads
        attention = 2 * hidden * heads * self.head_dim
        router = hidden * self.experts.count if self.experts.count > 1 else 0
        return self.num_layers * (attention + router) + self.vocab * hidden

    def total_params(self) -> int:
        """Every weight, the input embedding included (untied from the LM head)."""
        experts = self.num_layers * self.experts.count * self.experts.params
        return self.shared_params() + experts + self.vocab * self.experts.hidden

    def active_params(self) -> int:
        """The weights one token computes with, both embeddings included (as published)."""
        experts = self.num_layers * self.experts.per_token * self.experts.params
        return self.shared_params() + experts + self.vocab * self.experts.hidden

    def flops_per_token(self) -> float:
        """Prefill FLOPs of one token outside attention (no LM head: one token samples)."""
        lm_head = self.vocab * self.experts.hidden
        return 2.0 * (self.active_params() - 2 * lm_head)

    def attention_flops_per_pair(self) -> float:
        """FLOPs of QK^T and AV for one (query, key) pair over all layers."""
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim

    def kv_bytes_per_token(self) -> int:
        return int(
            2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value
        )

    def weight_bytes(self) -> float:
        return self.total_params() * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU's published figures and its share of the node's NICs, PCIe and DRAM."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nic_bytes_per_s: float
    pcie_bytes_per_s: float
    host_cache_bytes: float


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What the published peaks turn into; the 70B profiles' figures where they have one."""

    prefill_mfu: float = 0.40
    decode_hbm_efficiency: float = 0.60
    network_efficiency: float = 0.80
    decode_step_overhead_s: float = 0.002  # launch, routing and token permutation per step
    per_seq_s: float = 1.6e-5  # sampling, as the H100 profile
    workspace_bytes: float = 1.0e10  # activations, CUDA graphs, allocator slack
    transfer_latency_s: float = 0.001


# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 30.5B total, 3.3B active.
QWEN3_30B_A3B = ModelShape(
    "qwen3-30b-a3b", Experts(48, 2048, 768, count=128, per_token=8), 32, 4, 128, 151936
)
# Qwen3-32B (Qwen/Qwen3-32B config.json): the dense model of about the same total size.
QWEN3_32B = ModelShape("qwen3-32b", Experts(64, 5120, 25600), 64, 8, 128, 151936)
SHAPES = {shape.name: shape for shape in (QWEN3_30B_A3B, QWEN3_32B)}

# H200 SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s and 141 GB of HBM3e; one 400 Gb/s NIC and one PCIe
# Gen5 x16 (~50 GB/s) per GPU; an eighth of the 70B profiles' 1.6 TB host cache per node.
H200 = Gpu("h200", 9.89e14, 4.8e12, 1.41e11, 5.0e10, 5.0e10, 2.0e11)


def decode_step_s(
    shape: ModelShape, gpu: Gpu, eff: Efficiency, batch: float, kv_tokens: float
) -> float:
    """Seconds of one decode step of `batch` sequences reading `kv_tokens`: the curve."""
    experts = shape.experts
    expert_reads = shape.num_layers * experts.distinct(batch) * experts.params
    weights = (shape.shared_params() + expert_reads) * shape.bytes_per_param
    read_s = (weights + kv_tokens * shape.kv_bytes_per_token()) / hbm_bytes_per_s(gpu, eff)
    return eff.decode_step_overhead_s + eff.per_seq_s * batch + read_s


def decode_kv_capacity_tokens(shape: ModelShape, gpu: Gpu, eff: Efficiency) -> int:
    """KV tokens the GPU holds beside one copy of the weights and the workspace."""
    room = gpu.hbm_bytes - shape.weight_bytes() - eff.workspace_bytes
    return int(room // shape.kv_bytes_per_token())


def fit_batch_sizes(shape: ModelShape, gpu: Gpu, eff: Efficiency, context_tokens: int) -> range:
    """Batch sizes a decode instance holds at `context_tokens` a sequence, from 1."""
    return range(1, max(2, decode_kv_capacity_tokens(shape, gpu, eff) // context_tokens) + 1)


def fit_decode_curve(
    shape: ModelShape, gpu: Gpu, eff: Efficiency, batches: range, context_tokens: int
) -> tuple[float, float, float]:
    """The linear decode coefficients closest (in relative error) to the curve over `batches`,
    each at a full and a half context so the KV term is told apart from the batch term."""
    samples = [
        (b, b * ctx, decode_step_s(shape, gpu, eff, b, b * ctx))
        for b in batches
        for ctx in (context_tokens, context_tokens // 2)
    ]
    return fit_decode(samples, weights=[1 / s**2 for *_, s in samples])


def prefill_coef(shape: ModelShape, gpu: Gpu, eff: Efficiency) -> tuple[float, float, float, float]:
    """const (every weight read once), per token, per token^2 (causal half), per token x cached."""
    flops_s = gpu.peak_flops * eff.prefill_mfu
    pair = shape.attention_flops_per_pair()
    weights_s = shape.weight_bytes() / hbm_bytes_per_s(gpu, eff)
    return (weights_s, shape.flops_per_token() / flops_s, pair / 2 / flops_s, pair / flops_s)


def build_profile(
    shape: ModelShape, gpu: Gpu, eff: Efficiency = Efficiency(), fit_context_tokens: int = 12_000
) -> Profile:
    """The profile of `shape` served by one `gpu` (TP = 1), every figure computed here."""
    batches = fit_batch_sizes(shape, gpu, eff, fit_context_tokens)
    decode = fit_decode_curve(shape, gpu, eff, batches, fit_context_tokens)
    return Profile(
        name=f"{shape.name}-1x{gpu.name}",
        cost=CostModel(prefill_coef(shape, gpu, eff), decode),
        kv_bytes_per_token=shape.kv_bytes_per_token(),
        num_layers=shape.num_layers,
        network_bytes_per_s=gpu.nic_bytes_per_s * eff.network_efficiency,
        host_to_device_bytes_per_s=gpu.pcie_bytes_per_s,
        transfer_latency_s=eff.transfer_latency_s,
        decode_kv_capacity_tokens=decode_kv_capacity_tokens(shape, gpu, eff),
        cache_bytes_per_instance=gpu.host_cache_bytes,
        assumptions=_assumptions(shape, gpu, eff, batches, fit_context_tokens),
    )


def _assumptions(
    shape: ModelShape, gpu: Gpu, eff: Efficiency, batches: range, context_tokens: int
) -> dict:
    curve = fit_report(shape, gpu, eff, batches, context_tokens)
    return {
        "derived_by": "python -m halfmoon.router.sim.moe_profile (router/sim/moe_profile.py)",
        "model": {**asdict(shape), "experts": asdict(shape.experts)},
        "total_params": shape.total_params(),
        "active_params": shape.active_params(),
        "flops_per_token": shape.flops_per_token(),
        "weight_bytes": shape.weight_bytes(),
        "gpu": asdict(gpu),
        "efficiency": asdict(eff),
        "decode_fit_batches": [batches.start, batches.stop - 1],
        "decode_fit_context_tokens": context_tokens,
        "decode_curve_ms_at_context": curve,
    }


def fit_report(
    shape: ModelShape, gpu: Gpu, eff: Efficiency, batches: range, context_tokens: int
) -> dict[int, dict[str, float]]:
    """At a few batch sizes: experts a layer reads, the curve's and the fit's step in ms."""
    cost = CostModel(
        (0.0, 0.0, 0.0, 0.0), fit_decode_curve(shape, gpu, eff, batches, context_tokens)
    )
    report = {}
    for b in sorted({1, 2, 4, 8, 16, 32, 64, batches.stop - 1}):
        kv = b * context_tokens
        report[b] = {
            "experts": round(shape.experts.distinct(b), 1),
            "curve_ms": round(decode_step_s(shape, gpu, eff, b, kv) * 1e3, 2),
            "fit_ms": round(cost.decode_step_time(b, kv) * 1e3, 2),
        }
    return report


def hbm_bytes_per_s(gpu: Gpu, eff: Efficiency) -> float:
    """The HBM bandwidth a decode step's reads get."""
    return gpu.hbm_bytes_per_s * eff.decode_hbm_efficiency


def write_profile(profile: Profile, path: str | Path) -> None:
    """Write `profile` as YAML with a header naming how it was made."""
    header = (
        f"# {profile.name}: derived on paper by router/sim/moe_profile.py, not measured; "
        "regenerate with\n# python -m halfmoon.router.sim.moe_profile --shape "
        f"{profile.name.rsplit('-1x', 1)[0]} --out {Path(path).name}\n"
    )
    Path(path).write_text(header + yaml.safe_dump(profile_to_dict(profile), sort_keys=False))


def figures_text(shape: ModelShape, gpu: Gpu, eff: Efficiency = Efficiency()) -> str:
    """The figures docs/moe.md quotes, one per line."""
    profile = build_profile(shape, gpu, eff)
    cost, lines = profile.cost, [f"{profile.name}: {yaml.safe_dump(profile.assumptions['gpu'])}"]
    lines.append(
        f"params {shape.total_params() / 1e9:.2f}B total, {shape.active_params() / 1e9:.2f}B "
        f"active; {shape.kv_bytes_per_token()} KV B/token; decode KV "
        f"{profile.decode_kv_capacity_tokens} tokens"
    )
    for n in (1_000, 12_000, 32_000):
        lines.append(f"prefill {n} tokens: {cost.prefill_time(n) * 1e3:.1f} ms")
    lines.append(f"decode coef {cost.decode_coef}")
    lines.append(yaml.safe_dump(profile.assumptions["decode_curve_ms_at_context"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write a shape's profile (`--out`) or print its figures (`--figures`)."""
    parser = argparse.ArgumentParser(prog="python -m halfmoon.router.sim.moe_profile")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=QWEN3_30B_A3B.name)
    parser.add_argument("--out", help="YAML to write (default: print the figures)")
    parser.add_argument("--context-tokens", type=int, default=12_000, help="decode fit context")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.out:
        write_profile(build_profile(shape, H200, fit_context_tokens=args.context_tokens), args.out)
        return 0
    print(figures_text(shape, H200))
    return 0


if __name__ == "__main__":
    sys.exit(main())
