"""`halfmoon bench transfer`: the TTFT breakdown (prefill compute, transfer stall, rest) of
disaggregated prefill for prompts of 1 to 8 chunks on a live local cluster (1 prefill + 1 decode
worker; the ~50M model on cpu, the ~0.9B shape on cuda), side by side: layer-wise KV streaming
with the prefill worker's direct notices (kvstore/transfer/channel.py), the decode worker
copying each layer out of the prefill worker's own pages (path 'pages', the default) or out of
the store's shared arena ('arena'); streaming with the notices through the store and the
router's hand-off ('store', the path across nodes); and no streaming ('off'). Stall = the last
layer published to the request joining the decode batch; kv_in = the part of it until the KV was
all in the decode worker's pages, token = until the first token was known there; lent_layers =
layers copied out of the prefill worker's pages. `--prefill-tp P --decode-tp D`: the workers at
those tensor-parallel degrees (a prefill worker of P > 1 lends no pages: no 'pages' path)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from halfmoon.bench.device import (
    bench_model,
    int_list,
    live_bench_settings,
    parse_device_args,
)
from halfmoon.bench.options import bench_parser
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.cluster.worker.errors import WorkerCallError, unwrap
from halfmoon.decode_worker.task import DecodeTask
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.kvstore.keys import block_keys
from halfmoon.prefill_worker.task import PrefillTask


@dataclass(slots=True)
class Breakdown:
    """One request's TTFT split into parts (seconds)."""

    num_chunks: int
    layerwise: bool
    direct: bool
    ttft_s: float
    prefill_compute_s: float
    transfer_stall_s: float
    one_layer_s: float
    overhead_s: float
    # Of the stall, until the KV was all in the decode worker's pages (the rest waited for the
    # first token).
    kv_landed_s: float = 0.0
    token_known_s: float = 0.0  # likewise, until the first token was known there
    lent: bool = False  # the decode worker was offered the prefill worker's own pages
    page_copies: int = 0  # layers it copied out of them
    kv_bytes: int = 0  # the KV bytes the decode worker received for it

    @property
    def path(self) -> str:
        if not self.layerwise:
            return "off"
        return ("pages" if self.lent else "arena") if self.direct else "store"


PATHS = {  # layer-wise, direct notices, lent pages
    "pages": (True, True, True),
    "arena": (True, True, False),
    "store": (True, False, False),
    "off": (False, False, False),
}


async def measure(cluster: Cluster, token_ids: list[int], path: str, rid: str) -> Breakdown:
    """Run one request straight through a prefill and a decode worker as the router does
    (reserve and prefill sent together, then the hand-off) and time its parts."""
    prefill = cluster.workers["prefill-0"].actor
    decode = cluster.workers["decode-1"].actor
    layerwise, direct, lend = PATHS[path]
    store_name = await prefill.store_name.remote()
    peer = await decode.kv_peer.remote() if direct else None
    params = SamplingParams(max_tokens=1, temperature=0.0)
    before = (await prefill.counters.remote())["forward_s"]
    copies_before = (await decode.counters.remote())["num_page_copies"]
    keys = block_keys(cluster.info.root_key, token_ids, cluster.info.block_size)
    reserve = DecodeTask(rid, token_ids, params, keys, store_name=store_name, direct=direct)
    task = PrefillTask(rid, token_ids, params, keys, kv_peer=peer, layerwise=layerwise, lend=lend)
    started = time.time()
    reserved = decode.reserve.remote(reserve)
    prefilled = prefill.prefill.remote(task)
    unwrap(await reserved)
    result = unwrap(await prefilled)
    async for ref in decode.generate.options(num_returns="streaming").remote(
        rid, result.first_token_id
    ):
        unwrap(await ref)
    compute_s = (await prefill.counters.remote())["forward_s"] - before
    page_copies = (await decode.counters.remote())["num_page_copies"] - copies_before
    got = await decode.receive_timings.remote(rid)
    layers = cluster.info.num_layers
    units = -(-len(token_ids) // cluster.config.engine.prefill_chunk_size)
    one_layer_s = (got.all_received_at - got.first_layer_received_at) / max(1, units * layers - 1)
    ttft_s = got.joined_at - started
    return Breakdown(
        num_chunks=units,
        layerwise=layerwise,
        direct=direct,
        ttft_s=ttft_s,
        prefill_compute_s=compute_s,
        transfer_stall_s=got.joined_at - result.last_layer_published_at,
        one_layer_s=one_layer_s,
        overhead_s=ttft_s - compute_s,
        kv_landed_s=got.all_received_at - result.last_layer_published_at,
        token_known_s=got.first_token_at - result.last_layer_published_at,
        lent=lend,
        page_copies=page_copies,
        kv_bytes=got.num_bytes,
    )


async def run(
    cluster: Cluster,
    chunk_counts: list[int],
    chunk_tokens: int,
    repeats: int,
    seed: int,
    all_samples: list[Breakdown] | None = None,
    tag: str = "",
):
    """The best of `repeats` per chunk count and path; every sample also goes to
    `all_samples` when given (for the stall's percentiles). `tag` starts each request id."""
    rng = random.Random(seed)
    rows = []
    for num_chunks in chunk_counts:
        for path in paths(cluster.config.prefill.tensor_parallel_size):
            samples = []
            for r in range(repeats):
                ids = [
                    rng.randrange(6, cluster.info.vocab_size)
                    for _ in range(num_chunks * chunk_tokens)
                ]
                rid = f"{tag}b{num_chunks}-{path}-{r}"
                samples.append(await measure(cluster, ids, path, rid))
            rows.append(min(samples, key=lambda b: b.ttft_s))
            if all_samples is not None:
                all_samples.extend(samples)
    return rows


def paths(prefill_tp: int) -> list[str]:
    """The paths a prefill worker of degree `prefill_tp` offers: lent pages need one rank."""
    return [path for path in PATHS if prefill_tp == 1 or not PATHS[path][2]]


def degree_settings(prefill_tp: int, decode_tp: int) -> dict:
    """Both pools' degrees; where their ranks outnumber the cores, each rank reserves a share
    of them, so that the workers fit this machine (the reservation times nothing)."""
    settings = {
        "prefill.tensor_parallel_size": prefill_tp,
        "decode.tensor_parallel_size": decode_tp,
    }
    ranks = prefill_tp + decode_tp
    if ranks > (cores := os.cpu_count() or 1):
        settings |= {"prefill.num_cpus": cores / ranks, "decode.num_cpus": cores / ranks}
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--across-nodes" in argv:
        from halfmoon.bench.probes import transfer_nodes

        return transfer_nodes.main([arg for arg in argv if arg != "--across-nodes"])
    parser = bench_parser("transfer", __doc__)
    parser.add_argument(
        "--across-nodes",
        action="store_true",
        help="instead: KV moved between two Ray nodes made on this machine, side by side as Ray "
        "objects, on Mooncake's Transfer Engine over TCP and on a raw socket: a unit's bytes/s "
        "and the stall after the last layer (issue 48; its options: `halfmoon bench transfer "
        "--across-nodes --help`)",
    )
    parser.add_argument("--chunks", default="1,2,4,8", help="chunk counts (1,2,4,8)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("fp8", "fp8_e4m3", "fp8_e5m2", "int8"),
        help="instead: the same prompts on a cluster with KV in the model's dtype, then on one "
        "with KV in this 8-bit format; per path the stall's median and the KV bytes a unit "
        "moves, side by side, and their ratios",
    )
    parser.add_argument(
        "--chunk-tokens", type=int, help="prefill chunk size (64 on cpu, 256 on cuda)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per point: the table keeps the best, the stall's p50 and p99 use every run (3)",
    )
    for pool in ("prefill", "decode"):
        parser.add_argument(
            f"--{pool}-tp",
            type=int,
            default=1,
            help=f"the {pool} worker's tensor-parallel degree (1)",
        )
    args = parse_device_args(parser, argv, on_cpu="the ~50M model in fp32")
    chunk_counts = int_list(parser, "--chunks", args.chunks)
    chunk_tokens = args.chunk_tokens or (256 if args.device == "cuda" else 64)
    if min(chunk_counts) < 1 or chunk_tokens < 16 or chunk_tokens % 16 or args.repeats < 1:
        parser.error("--chunks and --repeats must be at least 1, --chunk-tokens a multiple of 16")
    if min(args.prefill_tp, args.decode_tp) < 1:
        parser.error("--prefill-tp and --decode-tp must be at least 1")
    settings = live_bench_settings(
        bench_model(args.device, args.model),
        args.device,
        **{
            "engine.prefill_chunk_size": chunk_tokens,
            "engine.max_num_batched_tokens": max(2048, chunk_tokens),
            **degree_settings(args.prefill_tp, args.decode_tp),
        },
    )
    if args.device != "cuda":
        settings["engine.num_pages"] = max(256, max(chunk_counts) * chunk_tokens // 16 + 16)
    if args.kv_cache_dtype:
        from halfmoon.bench.probes.transfer_kv import compare_kv_formats

        figures = compare_kv_formats(settings, args, chunk_counts, chunk_tokens)
        print(json.dumps(figures) if args.json else format_kv_formats(figures))
        return 0
    cluster = Cluster(load_config(None, settings))
    try:
        cluster.start()
        # Warm up on other prompts: the measured ones must not find their blocks cached.
        asyncio.run(run(cluster, [1], chunk_tokens, 1, args.seed + 1, tag="warm-"))
        samples: list[Breakdown] = []
        rows = asyncio.run(
            run(cluster, chunk_counts, chunk_tokens, args.repeats, args.seed, samples)
        )
    except WorkerCallError as error:  # e.g. a prompt beyond the model's context
        print(f"halfmoon bench transfer: {error}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()  # shuts Ray down too when it started it
    return _report(rows, args.json, args.device, samples, (args.prefill_tp, args.decode_tp))


def measure_cluster(settings: dict, args, chunk_counts: list[int], chunk_tokens: int) -> tuple:
    """(every sample of the measured prompts, the model's dtype) on a cluster of `settings`,
    after a warm-up."""
    cluster = Cluster(load_config(None, settings))
    try:
        cluster.start()
        asyncio.run(run(cluster, [1], chunk_tokens, 1, args.seed + 1, tag="warm-"))
        samples: list[Breakdown] = []
        asyncio.run(run(cluster, chunk_counts, chunk_tokens, args.repeats, args.seed, samples))
        return samples, cluster.info.dtype
    finally:
        cluster.stop()


def format_kv_formats(figures: dict) -> str:
    lines = [f"KV in {figures['model_dtype']} vs {figures['kv_cache_dtype']}, per path:"]
    for path, row in figures["by_path"].items():
        lines.append(
            f"  {path:>5}: stall p50 {row['stall_ms'][0]:.2f} vs {row['stall_ms'][1]:.2f} ms "
            f"({row['stall_ratio']:.2f}x), KV a unit {row['unit_bytes'][0]:,} vs "
            f"{row['unit_bytes'][1]:,} bytes ({row['bytes_ratio']:.3f}x)"
        )
    return "\n".join(lines)


def stall_percentiles(samples: list[Breakdown]) -> dict:
    """Issue 12's measure: per streaming path, the stall's p50 and p99 over every request,
    against the time one layer takes to move alone (the median interval between layers
    arriving when all were published before the first was read: the `off` path)."""
    moves = [s.one_layer_s for s in samples if s.path == "off"]
    if not moves:
        return {}
    move_s = float(np.median(moves))
    by_path = {}
    for path in ("pages", "arena", "store"):
        stalls = [s.transfer_stall_s for s in samples if s.path == path]
        if stalls:
            p50, p99 = np.percentile(stalls, [50, 99])
            by_path[path] = {
                "requests": len(stalls),
                "p50_ms": p50 * 1e3,
                "p99_ms": p99 * 1e3,
                "p50_over_layer_move": p50 / move_s,
                "p99_over_layer_move": p99 / move_s,
            }
    return {"layer_move_ms": move_s * 1e3, "by_path": by_path}


def _report(
    rows: list[Breakdown],
    as_json: bool,
    device: str = "cpu",
    samples: list[Breakdown] | None = None,
    degrees: tuple[int, int] = (1, 1),
) -> int:
    worst = {}  # per streaming path: the worst stall / one layer and TTFT / compute
    for path in ("pages", "arena", "store"):
        on = [r for r in rows if r.path == path]
        if not on:
            continue
        worst[path] = {
            "max_stall_over_one_layer": max(r.transfer_stall_s / r.one_layer_s for r in on),
            "max_ttft_over_compute": max(r.ttft_s / r.prefill_compute_s for r in on),
            "max_stall_ms": max(r.transfer_stall_s for r in on) * 1e3,
        }
    default = "pages" if "pages" in worst else "arena"  # the arena where no pages are lent
    summary = {
        "device": device,
        "prefill_tp": degrees[0],
        "decode_tp": degrees[1],
        "rows": [{**asdict(r), "path": r.path} for r in rows],
        # The default path, as these keys always reported.
        **{k: v for k, v in worst[default].items() if k != "max_stall_ms"},
        "by_path": worst,
        "stall_percentiles": stall_percentiles(samples or []),
    }
    if as_json:
        print(json.dumps(summary))
        return 0
    print(
        f"{'chunks':>6} {'path':>6} {'lent_layers':>11} {'ttft_ms':>8} {'compute_ms':>10} "
        f"{'stall_ms':>8} {'kv_in_ms':>8} {'token_ms':>8} {'layer_ms':>8} {'stall/layer':>11} "
        f"{'ttft/compute':>12}"
    )
    for r in rows:
        print(
            f"{r.num_chunks:>6} {r.path:>6} {r.page_copies:>11} "
            f"{r.ttft_s * 1e3:>8.1f} {r.prefill_compute_s * 1e3:>10.1f} "
            f"{r.transfer_stall_s * 1e3:>8.1f} {r.kv_landed_s * 1e3:>8.1f} "
            f"{r.token_known_s * 1e3:>8.1f} "
            f"{r.one_layer_s * 1e3:>8.2f} "
            f"{r.transfer_stall_s / r.one_layer_s:>11.2f} {r.ttft_s / r.prefill_compute_s:>12.3f}"
        )
    for path, w in worst.items():
        print(
            f"path {path}: worst stall = {w['max_stall_ms']:.1f} ms = "
            f"{w['max_stall_over_one_layer']:.2f} x one layer (goal <= 1.2), worst TTFT = "
            f"{w['max_ttft_over_compute']:.3f} x compute (goal <= 1.15)",
            file=sys.stderr,
        )
    percentiles = summary["stall_percentiles"]
    for path, p in percentiles.get("by_path", {}).items():
        print(
            f"path {path}: stall p50 = {p['p50_ms']:.1f} ms = {p['p50_over_layer_move']:.2f} x "
            f"moving one layer alone ({percentiles['layer_move_ms']:.2f} ms; goal <= 1.2), p99 = "
            f"{p['p99_ms']:.1f} ms = {p['p99_over_layer_move']:.2f} x (goal <= 3), "
            f"{p['requests']} requests",
            file=sys.stderr,
        )
    return 0
