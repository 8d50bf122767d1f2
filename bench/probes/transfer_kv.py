"""`halfmoon bench transfer --kv-cache-dtype K`: the same prompts through the same paths on a
cluster with its KV in the model's dtype, then on one with its KV in K (one after the other on
this machine), and per path the transfer stall's median and the KV bytes a transfer unit
moves, side by side, with their ratios (K's over the model dtype's)."""

from __future__ import annotations

import statistics

from halfmoon.bench.probes.transfer import Breakdown, measure_cluster


def compare_kv_formats(settings: dict, args, chunk_counts: list[int], chunk_tokens: int) -> dict:
    sides, dtype = {}, ""
    for kv in ("auto", args.kv_cache_dtype):
        kv_settings = {**settings, "engine.kv_cache_dtype": kv}
        sides[kv], dtype = measure_cluster(kv_settings, args, chunk_counts, chunk_tokens)
    by_path = {}
    for path in ("pages", "arena", "store", "off"):
        rows = [[s for s in samples if s.path == path] for samples in sides.values()]
        if not all(rows):
            continue
        stalls = [statistics.median(s.transfer_stall_s for s in side) * 1e3 for side in rows]
        units = [_unit_bytes(side) for side in rows]
        by_path[path] = {
            "stall_ms": stalls,
            "stall_ratio": stalls[1] / stalls[0],
            "unit_bytes": units,
            "bytes_ratio": units[1] / units[0],
        }
    return {
        "model_dtype": dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "chunk_tokens": chunk_tokens,
        "by_path": by_path,
    }


def _unit_bytes(samples: list[Breakdown]) -> int:
    """The KV bytes one transfer unit (a prefill chunk) moved, the median over the requests."""
    return int(statistics.median(s.kv_bytes / s.num_chunks for s in samples))
