"""`halfmoon bench rdt`: one request's KV moved layer by layer between two Ray actors, through
the store node (today's path), Ray Direct Transport and plain Ray object-store arguments."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass

import ray
import torch
from tqdm import tqdm

from halfmoon.bench.options import bench_parser
from halfmoon.bench.probes.rdt_actors import Pair, delivered_intact, start_pair
from halfmoon.kvstore.config import StoreConfig
from halfmoon.kvstore.layout import KvLayout
from halfmoon.kvstore.store_node import start_store_node

PATHS = ("store", "shared", "object", "gloo", "cuda_ipc", "nccl")


@dataclass(slots=True)
class Row:
    """One path at one prompt length: per-request transfer time over all layers."""

    path: str
    num_tokens: int
    request_bytes: int
    p50_ms: float
    p99_ms: float
    gbps: float
    vs_store: float  # store p50 / this p50: above 1 is faster than the store
    intact: bool


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def shape_layout(name: str, block_size: int) -> KvLayout:
    """The KV layout of a named checkpoint shape (tiny, bench or gpu), fp16."""
    # The shapes live with the checkpoint generator; only their sizes are read here.
    from halfmoon.engine.init_model import SHAPES

    shape = SHAPES[name]
    head_dim = shape.hidden_size // shape.num_attention_heads
    return KvLayout(shape.num_hidden_layers, block_size, shape.num_key_value_heads, head_dim)


def plan_paths(device: str, num_gpus: int) -> tuple[list[str], dict[str, str]]:
    """The paths this host can run, and why each other one is skipped."""
    if device == "cpu":
        why = "carries CUDA tensors: run with --device cuda on a GPU host"
        return ["store", "shared", "object", "gloo"], {"cuda_ipc": why, "nccl": why}
    if num_gpus >= 2:
        return list(PATHS), {}
    reason = f"NCCL joins one process per GPU; this host has {num_gpus} GPU (needs >= 2)"
    return ["store", "shared", "object", "gloo", "cuda_ipc"], {"nccl": reason}


def measure(args: argparse.Namespace, layout: KvLayout) -> tuple[list[Row], dict[str, str]]:
    num_gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    paths, skipped = plan_paths(args.device, num_gpus)
    tokens = [int(t) for t in args.tokens.split(",")]
    max_blocks = -(-max(tokens) // layout.block_size)
    capacity = max(StoreConfig().host_capacity_bytes, 4 * max_blocks * layout.block_bytes)
    store = start_store_node(
        layout, StoreConfig(host_capacity_bytes=capacity), name=f"bench-rdt-{os.getpid()}"
    )
    # One pair per phase: CUDA IPC needs both actors on one GPU, NCCL one GPU each.
    phases = [("gloo", 0.5 if args.device == "cuda" else 0, [p for p in paths if p != "nccl"])]
    if "nccl" in paths:
        phases.append(("nccl", 1, ["nccl"]))
    times: dict[tuple[str, int], list[float]] = {}
    intact: dict[str, bool] = {}
    try:
        with tqdm(total=len(tokens) * args.requests * len(paths), desc="bench rdt") as bar:
            for backend, gpus, phase_paths in phases:
                pair = start_pair(layout, max_blocks, args.device, store, backend, gpus)
                try:
                    intact |= {p: delivered_intact(pair, p, max_blocks) for p in phase_paths}
                    time_requests(pair, phase_paths, tokens, args.requests, layout, times, bar)
                finally:
                    ray.kill(pair.sender)
                    ray.kill(pair.receiver)
    finally:
        ray.kill(store)
    return rows(times, layout, intact), skipped


def time_requests(
    pair: Pair,
    paths: list[str],
    tokens: list[int],
    requests: int,
    layout: KvLayout,
    times: dict[tuple[str, int], list[float]],
    bar: tqdm,
) -> None:
    """Per-request seconds into `times[(path, num_tokens)]`, paths interleaved."""
    for num_tokens in tokens:
        blocks = -(-num_tokens // layout.block_size)
        for _ in range(requests):  # interleaved, so load from other processes hits every path
            for path in paths:
                seconds = ray.get(pair.sender.request.remote(path, blocks))
                times.setdefault((path, num_tokens), []).append(seconds)
                bar.update()


def rows(times: dict, layout: KvLayout, intact: dict[str, bool]) -> list[Row]:
    out = []
    for (path, num_tokens), samples in times.items():
        nbytes = -(-num_tokens // layout.block_size) * layout.block_bytes
        p50 = statistics.median(samples)
        store_p50 = statistics.median(times[("store", num_tokens)])
        out.append(
            Row(
                path,
                num_tokens,
                nbytes,
                p50 * 1e3,
                percentile(samples, 99) * 1e3,
                nbytes / p50 / 1e9,
                store_p50 / p50,
                intact[path],
            )
        )
    return sorted(out, key=lambda row: (row.num_tokens, PATHS.index(row.path)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(
        "rdt",
        description="Moves one request's KV, layer by layer, from a sender actor (as the "
        "prefill worker) to a receiver actor (as the decode worker) and prints per-request "
        "transfer time p50/p99 and GB/s for: store = put_layer through a real store node, read "
        "back through one stream as the decode worker reads (the path across nodes); shared = "
        "the layers copied into the store node's shared-memory arena with a claim and one "
        "notice per layer, and out of it by a reader told where they are (the workers' path "
        "when they share the store's node); "
        "object = the layer as a plain Ray object-store argument; gloo = "
        "Ray Direct Transport over gloo (CPU tensors, staged through host memory with --device "
        "cuda); and with --device cuda, tensors on the GPU: cuda_ipc = RDT over CUDA IPC (both "
        "actors on one GPU) and nccl = RDT over NCCL (one GPU each, needs >= 2). gloo and nccl "
        "move one layer at a time: Ray 2.60 sends them untagged, so layers in flight together "
        "can land swapped. vs_store = store p50 / path p50 (above 1: faster than the store). "
        "Every path is first checked to deliver the exact bytes sent (column intact; exit 1 "
        "if not).",
    )
    parser.add_argument(
        "--shape",
        choices=("tiny", "bench", "gpu"),
        default="tiny",
        help="tiny (~1M, serving default), bench (~50M), gpu (~0.9B)",
    )
    parser.add_argument("--tokens", default="128,1024,8192", help="prompt lengths (128,1024,8192)")
    parser.add_argument("--requests", type=int, default=20, help="requests per point (20)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both actors hold the KV (cpu)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; this host has none")
    return args


def report(rows_: list[Row], skipped: dict[str, str], args, layout: KvLayout) -> None:
    summary = {
        "device": args.device,
        "shape": args.shape,
        "layout": {"num_layers": layout.num_layers, "block_bytes": layout.block_bytes},
        "rows": [asdict(row) for row in rows_],
        "skipped": skipped,
    }
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"{'tokens':>6} {'MiB':>6} {'path':<8} {'p50 ms':>8} {'p99 ms':>8} {'GB/s':>7} "
        f"{'vs_store':>8} {'intact':>6}"
    )
    for r in rows_:
        print(
            f"{r.num_tokens:>6} {r.request_bytes / 2**20:>6.2f} {r.path:<8} {r.p50_ms:>8.2f} "
            f"{r.p99_ms:>8.2f} {r.gbps:>7.3f} {r.vs_store:>8.2f} {str(r.intact):>6}"
        )
    for path, why in skipped.items():
        print(f"skipped {path}: {why}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = shape_layout(args.shape, args.block_size)
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows_, skipped = measure(args, layout)
    finally:
        if started:
            ray.shutdown()
    report(rows_, skipped, args, layout)
    return 0 if all(row.intact for row in rows_) else 1


if __name__ == "__main__":
    raise SystemExit(main())
