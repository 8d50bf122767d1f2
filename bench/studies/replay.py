"""`halfmoon bench replay`: replay a Mooncake trace on the live local cluster, and the
simulator on the same scaled trace with the live workers' measured profile, side by side;
per request, the router's predicted TTFT against the measured one, live and simulated."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict

import ray

from halfmoon.bench.options import add_pool_options, add_slo_options, bench_parser
from halfmoon.bench.studies.replay_predictions import (
    Figures,
    PredictionFigures,
    Side,
    figures_of,
    live_views,
    prediction_summary,
    request_ids,
    request_rows,
    simulated_views,
)
from halfmoon.bench.workload import TRACE_BLOCK_TOKENS, prompt_tokens, scale_records
from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError
from halfmoon.cluster.config import load_config, router_config
from halfmoon.cluster.config_sections import ROUTER_DEFAULTS
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.router.cost_model import CostModel
from halfmoon.router.sim.simulation import SimInstances
from halfmoon.router.sim.step_simulation import make_simulation
from halfmoon.router.sim.summary import percentile
from halfmoon.router.sim.trace import TraceRecord, read_trace

SIDES = ("live", "simulated", "simulated_startup_profile")


async def replay_live(
    address: str, records, block_tokens: int, vocab_size: int, slo: tuple[float, float]
) -> Figures:
    """Send every record at its arrival time, under `request_ids`; TTFT and TBT as the client
    sees them."""
    served: list[tuple[float, float]] = []  # (TTFT, TBT or -1 for a single token)
    rejected, cached, prompt, last = 0, 0, 0, 0.0
    started = time.monotonic()

    async def one(client: AsyncClient, record: TraceRecord, request_id: str) -> None:
        nonlocal rejected, cached, prompt, last
        await asyncio.sleep(max(0.0, record.arrival_s - (time.monotonic() - started)))
        sent = time.monotonic()
        stamps = []
        try:
            async with client.generate(
                prompt_tokens(record, block_tokens, range(6, vocab_size)),
                request_id=request_id,
                max_tokens=record.num_output_tokens,
                ignore_eos=True,
                temperature=0.0,
            ) as stream:
                async for delta in stream:
                    stamps.append(time.monotonic())
                    if delta.usage is not None:
                        cached += delta.usage.cached_tokens
                        prompt += delta.usage.prompt_tokens
        except ServerError as error:
            if error.code != "RESOURCE_EXHAUSTED":
                raise
            rejected += 1
            return
        tbt = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else -1.0
        served.append((stamps[0] - sent, tbt))
        last = max(last, stamps[-1] - started)

    ids = request_ids(len(records))
    async with AsyncClient(address) as client:
        await asyncio.gather(*(one(client, r, i) for r, i in zip(records, ids, strict=True)))
    ttft_slo, tbt_slo = slo
    met = sum(1 for ttft, tbt in served if ttft <= ttft_slo and tbt <= tbt_slo)
    ttfts = sorted(ttft for ttft, _ in served) or [0.0]
    tbts = sorted(tbt for _, tbt in served if tbt >= 0) or [0.0]
    return Figures(
        len(records),
        rejected,
        statistics.fmean(ttfts),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.9),
        percentile(ttfts, 0.99),
        statistics.fmean(tbts),
        percentile(tbts, 0.99),
        met / max(len(records), 1),
        cached / max(prompt, 1),
        len(served) / max(last - records[0].arrival_s, 1e-9),
    )


def simulate(cluster: Cluster, profile, records, block_tokens: int, router_profile=None) -> Side:
    """The replayed records on simulated instances timed by `profile`, the Conductor starting
    from `router_profile` (default: the same) and refitting online, as the live one does."""
    config = cluster.config
    pools = cluster.pools
    router = router_config(config, block_tokens)
    cache_blocks = cluster.info.num_pages
    engine = config.engine
    instances = SimInstances(
        profile,
        pools["prefill"].replicas,
        pools["decode"].replicas,
        cache_blocks,
        engine.max_num_batched_tokens,
        engine.max_num_seqs,
    )
    sim = make_simulation(router, instances, router_profile)
    summary = sim.run(records, progress=False)
    return Side(figures_of(summary), simulated_views(sim))


def live_side(cluster: Cluster, address: str, records: list[TraceRecord], args) -> Side:
    """The replay on the started cluster at `address`, and the router's summary of each
    request."""
    slo = (args.ttft_slo or math.inf, args.tbt_slo or math.inf)
    figures = asyncio.run(
        replay_live(address, records, args.block_tokens, cluster.info.vocab_size, slo)
    )
    ids = request_ids(len(records))
    views = live_views(ray.get(cluster.router.summaries.remote(ids)), ids)
    if missing := views.count(None):
        print(f"the router kept no summary of {missing} of {len(ids)} requests", file=sys.stderr)
    return Side(figures, views)


def observed_profile(cluster: Cluster, startup):
    """The start-up profile with its cost model fitted to the engine steps the live workers
    ran, and the hand-off time the router observed; and the number of those steps."""
    steps = ray.get(cluster.router.observed_steps.remote())
    refitted = ray.get(cluster.router.profile.remote())
    cost = CostModel.fit_steps(steps, startup.cost.chunk_tokens, startup.cost)
    return dataclasses.replace(startup, cost=cost, handoff_s=refitted.handoff_s), len(steps)


def replay(args, records: list[TraceRecord]) -> dict:
    """Start the cluster, replay live, simulate with the observed and the start-up profile,
    stop; the result as plain data (what --json prints)."""
    cluster = Cluster(cluster_config(args))
    try:
        ports = cluster.start()
        startup = ray.get(cluster.router.profile.remote())  # measured and calibrated, not refit
        live = live_side(cluster, f"127.0.0.1:{ports['grpc_port']}", records, args)
        observed, num_steps = observed_profile(cluster, startup)
        sides = {
            "live": live,
            "simulated": simulate(cluster, observed, records, args.block_tokens, startup),
            "simulated_startup_profile": simulate(cluster, startup, records, args.block_tokens),
        }
    finally:
        cluster.stop()  # shuts Ray down too when it started it; a caller's Ray stays up
    return replay_result(args, records, sides, profile_summary(startup, observed, num_steps))


def profile_summary(startup, observed, num_steps: int) -> dict:
    """The start-up and the observed profile, as plain data."""
    return {
        "request_overhead_s": startup.request_overhead_s,
        "handoff_s": observed.handoff_s,
        "startup": startup.cost.to_dict(),
        "observed_live": observed.cost.to_dict(),
        "steps_observed": num_steps,
    }


def replay_result(args, records: list[TraceRecord], sides: dict[str, Side], profiles: dict) -> dict:
    """The figures of every side, their ratio, the profiles, the prediction summary and the
    per-request rows, as plain data."""
    live, simulated = sides["live"].figures, sides["simulated"].figures
    ratio = simulated.ttft_mean_s / live.ttft_mean_s if live.ttft_mean_s else math.nan
    views = {name: side.views for name, side in sides.items()}
    return {
        "scale": scale_summary(args, len(records)),
        **{name: asdict(side.figures) for name, side in sides.items()},
        "sim_over_live_ttft_mean": ratio,
        "profiles": profiles,
        "predictions": prediction_summary(views),
        "request_rows": request_rows(records, views),
    }


def scale_summary(args, num_requests: int) -> dict:
    """How the trace was scaled and the cluster it ran on."""
    return {
        "trace": args.trace,
        "requests": num_requests,
        "block_tokens": args.block_tokens,
        "token_scale": args.block_tokens / TRACE_BLOCK_TOKENS,
        "time_scale": args.time_scale,
        "prefill": args.prefill,
        "decode": args.decode,
        "policy": args.policy,
        "bypass_tokens": args.bypass_tokens,  # None: the router's default
    }


def cluster_config(args):
    """The local cluster to replay on: the requested pools, block size and router settings."""
    bypass = (
        {} if args.bypass_tokens is None else {"router.bypass_threshold_tokens": args.bypass_tokens}
    )
    cpus = worker_cpus(args.prefill + args.decode)
    return load_config(
        None,
        bypass
        | {
            "server.grpc_port": 0,
            "server.metrics_port": 0,
            "server.http_port": "off",
            "prefill.replicas": args.prefill,
            "prefill.num_cpus": cpus,
            "decode.num_cpus": cpus,
            "decode.replicas": args.decode,
            "router.policy": args.policy,
            "router.admission": args.admission,
            "slo.ttft_s": args.ttft_slo,
            "slo.tbt_s": args.tbt_slo,
            "engine.block_size": args.block_tokens,
            "engine.prefill_chunk_size": 4 * args.block_tokens,
            "engine.num_pages": 1024,
            "store.use_local_redis": False,
        },
    )


def worker_cpus(num_workers: int) -> float:
    """Ray CPUs per worker: one each, or an equal share when there are more workers than this
    machine's cores (else the last ones would wait for a CPU forever)."""
    return min(1.0, (os.cpu_count() or 1) / num_workers)


def build_parser():
    """The options of `halfmoon bench replay`."""
    parser = bench_parser(
        "replay",
        description="Replay the first N requests of a Mooncake trace on a live local cluster "
        "(hash ids -> seeded token blocks, lengths and times scaled) and simulate the same "
        "scaled trace step by step with the live workers' profile as observed during the "
        "replay (engine steps, hand-off time), and with the start-up profile alone; prints "
        "the simulator's figures for all three side by side. Then, per side, the router's "
        "TTFT prediction error over the requests all three report: the median and p90 of "
        "|predicted - measured| / measured (live: the TTFT the router predicted when it placed "
        "the request against the one it measured; simulated: the simulated Conductor's "
        "prediction against the simulated TTFT), the median signed error (bias; below 0 "
        "predicts too short), the prompt tokens found cached, and the prefixes fetched from "
        "elsewhere (live: loaded from the KV store) with their tokens; and the live over the "
        "simulated cache-hit tokens. --time-scale 4 sends arrivals 4x closer together so "
        "prefill queues form.",
    )
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--requests", type=int, default=120, help="first N requests (120)")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="tokens per trace block after scaling (16; the trace has 512)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="arrival speed-up: live time = trace time / X, e.g. 4 for arrivals 4x closer "
        "together, 0.5 for 2x further apart (1.0)",
    )
    add_pool_options(parser, prefill=1, decode=1)
    parser.add_argument("--policy", default="conductor", help="routing policy (conductor)")
    parser.add_argument(
        "--admission",
        default="none",
        choices=("none", "early_rejection", "prediction_early_rejection"),
        help="SLO admission of the live router and the simulated one (none)",
    )
    parser.add_argument(
        "--bypass-tokens",
        type=int,
        help="prefill a prompt on its decode worker when at most this many of its tokens are "
        "uncached, live and simulated (router.bypass_threshold_tokens, default "
        f"{ROUTER_DEFAULTS.bypass_max_tokens}); 0 sends every prompt through a prefill worker",
    )
    parser.add_argument(
        "--rows",
        metavar="PATH",
        help="also write one JSON line per request to PATH: its id, lengths and arrival, and "
        "for live and each simulation the predicted and measured TTFT, cached and fetched "
        "tokens, instances and outcome (--json carries the same rows as request_rows)",
    )
    add_slo_options(parser, "TTFT SLO in seconds (none)", "TBT SLO in seconds (none)")
    return parser


def print_figures(result: dict) -> None:
    """The headline figures of every side, one line each."""
    print(f"scale: {json.dumps(result['scale'])}")
    print_sides(
        f"{'ttft_mean':>10} {'p50':>8} {'p90':>8} {'p99':>8} {'tbt_mean':>9} "
        f"{'tbt_p99':>8} {'slo_met':>8} {'hit_rate':>8} {'rejected':>8} {'req/s':>6}",
        [figures_row(Figures(**result[side])) for side in SIDES],
    )
    profiles = result["profiles"]
    print(
        f"sim: instances timed by the profile fitted to the {profiles['steps_observed']} live "
        "engine steps, the Conductor starting from the start-up profile; sim@start: start-up "
        f"profile only; calibrated per-request overhead {profiles['request_overhead_s'] * 1e3:.1f}"
        f" ms, observed hand-off {profiles['handoff_s'] * 1e3:.1f} ms"
    )


def print_predictions(predictions: dict) -> None:
    """Each side's TTFT prediction error and cache use, and the live over simulated hits."""
    print(
        f"TTFT predicted vs measured over the {predictions['live']['requests']} requests every "
        "side reports (error = |pred - meas| / meas; bias: median (pred - meas) / meas):"
    )
    print_sides(
        f"{'predicted':>9} {'err_p50':>8} {'err_p90':>8} {'bias_p50':>8} "
        f"{'queued':>6} {'bypassed':>8} {'cached_tok':>10} {'fetches':>8} {'fetch_tok':>9}",
        [predictions_row(PredictionFigures(**predictions[side])) for side in SIDES],
    )
    print(f"cache-hit tokens live / sim = {predictions['cached_live_over_sim']:.3f}")


def print_sides(header: str, rows: list[str]) -> None:
    """A table with one row per side, each led by the side's short name."""
    print(f"{'':>10} {header}")
    for name, row in zip(("live", "sim", "sim@start"), rows, strict=True):
        print(f"{name:>10} {row}")


def figures_row(f: Figures) -> str:
    return (
        f"{f.ttft_mean_s:>10.4f} {f.ttft_p50_s:>8.4f} {f.ttft_p90_s:>8.4f} "
        f"{f.ttft_p99_s:>8.4f} {f.tbt_mean_s:>9.5f} {f.tbt_p99_s:>8.4f} "
        f"{f.slo_attainment:>8.3f} {f.hit_rate:>8.3f} {f.rejected:>8} {f.throughput_rps:>6.2f}"
    )


def predictions_row(p: PredictionFigures) -> str:
    return (
        f"{p.predicted:>9} {p.error_p50:>8.3f} {p.error_p90:>8.3f} "
        f"{p.bias_p50:>8.3f} {'-' if p.queued is None else p.queued:>6} {p.bypassed:>8} "
        f"{p.cached_tokens:>10} {p.fetches:>8} {p.fetched_tokens:>9}"
    )


def write_rows(path: str, rows: list[dict]) -> None:
    """The per-request rows as JSON lines."""
    with open(path, "w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    options = build_parser()
    args = options.parse_args(argv)
    if args.time_scale <= 0:
        options.error(f"--time-scale {args.time_scale} must be a positive speed-up factor")
    raw, _ = read_trace(args.trace)
    records = scale_records(raw[: args.requests], args.block_tokens, args.time_scale)
    outcome = replay(args, records)
    if args.rows:
        write_rows(args.rows, outcome["request_rows"])
    if args.json:
        print(json.dumps(outcome))
        return 0
    print_figures(outcome)
    print_predictions(outcome["predictions"])
    ratio = outcome["sim_over_live_ttft_mean"]
    print(f"simulated / live mean TTFT = {ratio:.3f} (goal within 0.75-1.25)", file=sys.stderr)
    return 0
