"""`halfmoon bench engine --tp T`: our engine at tensor_parallel_size T against T = 1 on the
same requests and threads (the T ranks split them), one engine loaded at a time."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, our_llm, time_ours


def compare_degrees(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Our engine at T=1, then at T=`--tp`, each on the same threads; the best of `--repeats`
    runs each."""
    walls = {degree: _best_wall(model_dir, work, dtype, args, degree) for degree in (1, args.tp)}
    tokens = work.num_output_tokens
    return {
        "tp": args.tp,
        "tp1_tok_s": tokens / walls[1],
        "tp_tok_s": tokens / walls[args.tp],
        "ratio_tp_vs_tp1": walls[1] / walls[args.tp],
    }


def _best_wall(model_dir: Path, work: Workload, dtype: torch.dtype, args, degree: int) -> float:
    llm = our_llm(model_dir, args.batch_size, args.device, dtype, tensor_parallel_size=degree)
    try:
        walls = [time_ours(llm, work).wall_s for _ in range(args.repeats)]
    finally:
        llm.close()  # its ranks' threads go back to the next engine
    print(f"ours at T={degree}: {min(walls):.1f}s (best of {len(walls)})", file=sys.stderr)
    return min(walls)
