"""`halfmoon bench engine --vs-dtype D` (or `--vs-kv-cache-dtype K`): our engine in `--dtype`
(with its KV in `--kv-cache-dtype`) against itself in D (with its KV in K) on the same
requests and threads, both loaded at once, turns alternating (theirs, then ours), each timed
run on idle CPUs."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from halfmoon.bench.engine import Workload, our_llm, time_ours
from halfmoon.bench.probes.engine_turns import rounded, timed_turns


def compare_dtypes(model_dir: Path, work: Workload, dtype: torch.dtype, args) -> dict:
    """Medians of `--repeats` turns after an untimed one, and the median of each turn's ratio
    (theirs' wall over ours: above 1, ours is faster)."""
    ours = (dtype, args.kv_cache_dtype)
    if args.vs_kv_cache_dtype:
        theirs, name = (dtype, args.vs_kv_cache_dtype), f"kv_{args.vs_kv_cache_dtype}"
    else:
        theirs, name = (getattr(torch, args.vs_dtype), args.kv_cache_dtype), args.vs_dtype
    engines = {
        side: our_llm(model_dir, args.batch_size, args.device, d, kv_cache_dtype=kv)
        for side, (d, kv) in (("theirs", theirs), ("ours", ours))
    }
    for llm in engines.values():
        time_ours(llm, work)
    walls = timed_turns(engines, work, args.repeats, {"ours": "ours", "theirs": name})
    ratios = [t / o for o, t in zip(walls["ours"], walls["theirs"], strict=True)]
    tokens = work.num_output_tokens
    figures = {
        "ours_tok_s": tokens / statistics.median(walls["ours"]),
        f"{name}_tok_s": tokens / statistics.median(walls["theirs"]),
        f"ratio_vs_{name}": statistics.median(ratios),
        f"ratios_vs_{name}": rounded(ratios),
    }
    kv_pages = {side: llm.engine.num_pages for side, llm in engines.items()}
    if kv_pages["ours"] != kv_pages["theirs"]:  # the same memory holds more pages in 8 bits
        figures |= {"ours_kv_pages": kv_pages["ours"], f"{name}_kv_pages": kv_pages["theirs"]}
    return figures
