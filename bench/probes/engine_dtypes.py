"""`halfmoon bench engine --vs-dtype D`: our engine in `--dtype` against itself in D on the same
requests and threads, both loaded at once, turns alternating (D, then `--dtype`), each timed
run on idle CPUs."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, our_llm, time_ours
from halfmoon.bench.probes.engine_turns import after_quiet, rounded


def compare_dtypes(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Medians of `--repeats` turns after an untimed one, and the median of each turn's ratio
    (D's wall over `--dtype`'s: above 1, `--dtype` is faster)."""
    other = getattr(torch, args.vs_dtype)
    name = args.vs_dtype
    engines = {d: our_llm(model_dir, args.batch_size, args.device, d) for d in (other, dtype)}
    walls: dict[torch.dtype, list[float]] = {d: [] for d in engines}
    for llm in engines.values():
        time_ours(llm, work)
    for turn in range(args.repeats):
        for d, llm in engines.items():
            walls[d].append(after_quiet(time_ours, llm, work)[0])
        ours_s, theirs_s = walls[dtype][-1], walls[other][-1]
        print(f"turn {turn}: ours {ours_s:.1f}s, {name} {theirs_s:.1f}s", file=sys.stderr)
    ratios = [theirs / ours for ours, theirs in zip(walls[dtype], walls[other], strict=True)]
    tokens = work.num_output_tokens
    return {
        "ours_tok_s": tokens / statistics.median(walls[dtype]),
        f"{name}_tok_s": tokens / statistics.median(walls[other]),
        f"ratio_vs_{name}": statistics.median(ratios),
        f"ratios_vs_{name}": rounded(ratios),
    }
