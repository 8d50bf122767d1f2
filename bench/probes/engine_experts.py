"""`halfmoon bench engine --vs-expert-loop`: our engine with its experts grouped (each expert one
GEMM over the tokens routed to it) against itself with one expert MLP per (token, slot), the
loop grouping replaced (`Experts.group_tokens` off), on the same requests and threads, both
loaded at once, turns alternating (the loop, then grouped), each timed run on idle CPUs; and
the two in kernels/moe.py alone (`fused_moe_reference`, `moe_per_token_loop`) at the model's
expert shape."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, our_llm, time_ours
from halfmoon.bench.probes.engine_turns import rounded, timed_turns
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.moe_block import Experts
from halfmoon.kernels import moe

KERNEL_TOKENS = (1, 16, 256)
KERNEL_RUNS = 7  # timed calls of each kernel at each token count; the median counts


def compare_expert_loop(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Medians of `--repeats` turns after an untimed one, the median of each turn's ratio (the
    loop's wall over grouped: above 1, grouping is faster), whether both generated the same
    greedy tokens, and the kernels' figures."""
    engines = {side: our_llm(model_dir, args.batch_size, "cpu", dtype) for side in ("loop", "ours")}
    for module in engines["loop"].engine.model.modules():
        if isinstance(module, Experts):
            module.group_tokens = False
    tokens = {side: time_ours(llm, work).token_ids for side, llm in engines.items()}
    walls = timed_turns(engines, work, args.repeats, {"ours": "grouped", "loop": "expert loop"})
    ratios = [loop / ours for ours, loop in zip(walls["ours"], walls["loop"], strict=True)]
    num_tokens = work.num_output_tokens
    return {
        "ours_tok_s": num_tokens / statistics.median(walls["ours"]),
        "expert_loop_tok_s": num_tokens / statistics.median(walls["loop"]),
        "ratio_vs_expert_loop": statistics.median(ratios),
        "ratios_vs_expert_loop": rounded(ratios),
        "same_tokens_as_expert_loop": tokens["ours"] == tokens["loop"],
        "kernel_vs_loop": kernel_figures(model_dir, dtype),
    }


def kernel_figures(model_dir: Path, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Per token count of `KERNEL_TOKENS`: the median milliseconds of `fused_moe_reference` and of
    `moe_per_token_loop` on seeded random inputs of the model's expert shape, routed as its
    router routes (the top k of a softmax), and the loop's over grouped."""
    config = load_model_config(model_dir)
    shape, hidden = config.moe, config.hidden_size
    generator = torch.Generator().manual_seed(0)

    def random(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.05).to(dtype)

    experts, size = shape.num_experts, shape.expert_intermediate_size
    w_gate_up, w_down = random(experts, 2 * size, hidden), random(experts, hidden, size)
    figures = {}
    for num_tokens in KERNEL_TOKENS:
        logits = torch.randn(num_tokens, experts, generator=generator)
        weights, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
        inputs = (random(num_tokens, hidden), w_gate_up, w_down, ids, weights.to(dtype))
        grouped_ms = _median_ms(moe.fused_moe_reference, inputs)
        loop_ms = _median_ms(moe.moe_per_token_loop, inputs)
        figures[num_tokens] = {
            "grouped_ms": round(grouped_ms, 4),
            "loop_ms": round(loop_ms, 4),
            "ratio": round(loop_ms / grouped_ms, 3),
        }
    return figures


def _median_ms(kernel, inputs: tuple) -> float:
    kernel(*inputs)  # untimed: first-call allocations
    walls = []
    for _ in range(KERNEL_RUNS):
        started = time.perf_counter()
        kernel(*inputs)
        walls.append(time.perf_counter() - started)
    return statistics.median(walls) * 1e3
