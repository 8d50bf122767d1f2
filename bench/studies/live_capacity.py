"""`halfmoon bench live-capacity`: the capacity simulator checked against a running cluster.

The same requests (lengths, prompts' block structure, arrival times) go, at three rates, to the
live cluster through `bench serve`'s load generator and to the simulator `bench capacity` uses
(request-level disaggregated simulation, or colocated continuous batching), set up as the
cluster is: its mode, its instance counts, its router settings and its profile (measured from
its workers at start and refit online, as `GetServerInfo` reports it; or --profile). Per rate:
the share of requests within both SLOs (TTFT and TBT = decode time per decoded token; failed or
rejected requests miss), live and simulated, and whether they agree within --tolerance. Exit
status 2 when the server cannot be reached or mirrored.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import statistics
import sys
import time

from halfmoon.bench import serve as bench_serve
from halfmoon.bench.metrics import summarize
from halfmoon.bench.options import (
    add_server_options,
    add_slo_options,
    add_workload_options,
    bench_parser,
)
from halfmoon.bench.studies import live_shape, live_sim
from halfmoon.bench.targets import TargetUnreachableError, make_target
from halfmoon.bench.workload import WorkloadError, scale_records
from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.config import EngineSection
from halfmoon.router.errors import ProfileError, RouterConfigError, TraceFormatError
from halfmoon.router.profile import load_profile
from halfmoon.router.sim.trace import read_trace

DEFAULT_FRACTIONS = (0.5, 1.0, 1.5)
# Rates are judged against this share of requests within both SLOs when they are picked as
# fractions of the simulated capacity (Mooncake's definition of capacity).
DEFAULT_TARGET = 0.9
WARMUP_REQUESTS = 2
WARMUP_SEED = 1_000_003  # far from the runs' seeds, so warm-up prompts share no prefix with them


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("live-capacity", __doc__, progress=True)
    add_server_options(parser.add_argument_group("server"), "seconds per request (%(default)s)")
    work = parser.add_argument_group("workload (as `bench serve`)")
    add_workload_options(
        work,
        48,
        "requests per rate (%(default)s)",
        "seed of the first rate's prompts and arrivals; rate i uses seed + i, so no rate "
        "reuses another's prompts from the cache (%(default)s)",
    )
    work.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)"
    )
    rates = parser.add_argument_group("rates and SLOs")
    rates.add_argument(
        "--rates",
        type=parse_rates,
        help="request rates to run, req/s, comma-separated (default: --fractions of the "
        "simulated capacity)",
    )
    rates.add_argument(
        "--fractions",
        type=parse_rates,
        default=DEFAULT_FRACTIONS,
        help="fractions of the simulated capacity to run at (default: 0.5,1,1.5)",
    )
    rates.add_argument(
        "--target",
        type=float,
        default=DEFAULT_TARGET,
        help="share of requests within the SLOs that defines the capacity (%(default)s)",
    )
    add_slo_options(
        rates,
        f"TTFT SLO, seconds (default: {live_shape.TTFT_SLO_X:g}x the profile's unloaded TTFT "
        "of the mean request: prefill, per-request overhead and KV transfer)",
        f"TBT SLO, seconds (default: {live_shape.TBT_SLO_X:g}x the profile's decode step of "
        "one sequence at the mean context)",
    )
    rates.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="largest |live - simulated| attainment that agrees (%(default)s)",
    )
    sim = parser.add_argument_group("simulator")
    sim.add_argument(
        "--profile",
        help="profile YAML to simulate with (default: the server's own, from GetServerInfo)",
    )
    sim.add_argument(
        "--max-batched-tokens",
        type=int,
        default=EngineSection.model_fields["max_num_batched_tokens"].default,
        help="colocated engines' token budget per step, as the cluster's "
        "engine.max_num_batched_tokens (%(default)s)",
    )
    return parser


def parse_rates(text: str) -> tuple[float, ...]:
    """`2,4,8` as positive finite floats."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write numbers, e.g. 2,4,8") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive numbers")
    return values


def serve_args(args, rate: float, seed: int, num_prompts: int) -> argparse.Namespace:
    """`bench serve`'s options for one run of this workload at `rate`."""
    ns = bench_serve.build_parser().parse_args([])
    ns.server, ns.api_key, ns.request_timeout = args.server, args.api_key, args.request_timeout
    ns.num_prompts, ns.trace, ns.block_tokens = num_prompts, args.trace, args.block_tokens
    ns.random_input_len, ns.random_output_len = args.random_input_len, args.random_output_len
    ns.random_range_ratio, ns.seed, ns.burstiness = args.random_range_ratio, seed, args.burstiness
    ns.random_output_range_ratio = args.random_output_range_ratio
    ns.request_rate, ns.disable_tqdm = rate, args.disable_tqdm
    ns.arrival = "poisson"
    return ns


def make_requests(args, rate: float, seed: int, vocabulary, num_prompts: int | None = None):
    """The requests of one run (and their trace hash ids, or None for random prompts)."""
    count = num_prompts or args.num_prompts
    requests = bench_serve.build_requests(serve_args(args, rate, seed, count), vocabulary)
    if not args.trace:
        return requests, None
    records, _ = read_trace(args.trace)
    records = scale_records(records[:count], args.block_tokens, 1.0)
    return requests, [r.hash_ids for r in records]


def fetch_shape(args) -> live_shape.ClusterShape:
    """Ask the server what it is."""
    profile = load_profile(args.profile) if args.profile else None
    try:
        with Client(args.server, api_key=args.api_key) as client:
            info = client.server_info(timeout=10.0)
    except ServerError as error:
        raise TargetUnreachableError(
            f"cannot reach the halfmoon gRPC server at {args.server} ({error}); start one with "
            "`halfmoon serve`, or point --server at a running one"
        ) from None
    return live_shape.shape_from_server(info.details, info.mode, info.model, profile)


def run_live(args, requests, vocabulary, tokenizer, rate: float, seed: int) -> dict:
    """Send the requests through `bench serve`'s gRPC target; its summary."""
    ns = serve_args(args, rate, seed, len(requests))
    target = make_target(args.server, ns, tokenizer)
    results, duration_s = asyncio.run(bench_serve.bench_target(target, requests, vocabulary, ns))
    slos_ms = {"ttft": args.ttft_slo * 1e3, "tpot": args.tbt_slo * 1e3}
    return summarize(results, duration_s, [50.0, 99.0], slos_ms)


def run(args) -> dict:
    """The whole check, as `--json` prints it."""
    if not 0 < args.target <= 1 or not 0 <= args.tolerance < 1 or args.num_prompts < 2:
        raise live_shape.LiveCapacityError(
            f"--target {args.target} must be in (0, 1], --tolerance {args.tolerance} in [0, 1) "
            f"and --num-prompts {args.num_prompts} >= 2"
        )
    shape = fetch_shape(args)
    tokenizer, vocabulary = bench_serve.load_vocabulary(None)
    block_size = args.block_tokens if args.trace else shape.router.block_size
    base, hash_ids = make_requests(args, 1.0, args.seed, vocabulary)
    mean_prompt = statistics.fmean(len(r.prompt_token_ids) for r in base)
    mean_output = statistics.fmean(r.max_tokens for r in base)
    slo_ttft, slo_tbt = live_shape.default_slos(shape, mean_prompt, mean_output)
    args.ttft_slo = args.ttft_slo or slo_ttft
    args.tbt_slo = args.tbt_slo or slo_tbt
    slos = (args.ttft_slo, args.tbt_slo)
    capacity = live_sim.simulated_capacity(
        shape,
        live_sim.to_records(base, hash_ids, block_size),
        block_size,
        args.max_batched_tokens,
        slos,
        args.target,
    )
    rates = (
        list(args.rates) if args.rates else live_sim.rates_from_capacity(capacity, args.fractions)
    )
    warm, _ = make_requests(args, math.inf, WARMUP_SEED, vocabulary, WARMUP_REQUESTS)
    run_live(args, warm, vocabulary, tokenizer, math.inf, WARMUP_SEED)
    points = []
    for i, rate in enumerate(rates):
        seed = args.seed + i
        requests, hash_ids = make_requests(args, rate, seed, vocabulary)
        started = time.perf_counter()
        live = run_live(args, requests, vocabulary, tokenizer, rate, seed)
        records = live_sim.to_records(requests, hash_ids, block_size)
        sim = live_sim.simulate(shape, records, block_size, args.max_batched_tokens, slos)
        points.append((rate, live, sim, records, time.perf_counter() - started))
    # The server's profile once its router has refit it online from the steps just run: how
    # much of a gap the profile explains (what is left is queueing, transfer, overheads).
    refit = None if args.profile else fetch_shape(args)
    refit_sims = [
        None
        if refit is None
        else live_sim.simulate(refit, p[3], block_size, args.max_batched_tokens, slos)
        for p in points
    ]
    agreements = live_sim.compare(
        [p[0] for p in points],
        [p[1]["slo_attainment"] for p in points],
        [p[2].attainment for p in points],
        args.tolerance,
    )
    return {
        "server": args.server,
        "mode": shape.mode,
        "instances": shape.instances,
        "model": shape.model,
        "profile": shape.profile.name,
        "profile_cost": shape.profile.cost.to_dict(),
        "profile_refit_cost": None if refit is None else refit.profile.cost.to_dict(),
        "request_overhead_s": shape.profile.request_overhead_s,
        "handoff_s": shape.profile.handoff_s,
        "policy": shape.router.policy,
        "workload": {
            "trace": args.trace,
            "num_prompts": args.num_prompts,
            "mean_input_tokens": mean_prompt,
            "mean_output_tokens": mean_output,
            "arrival": "poisson",
            "burstiness": args.burstiness,
        },
        "ttft_slo_s": args.ttft_slo,
        "tbt_slo_s": args.tbt_slo,
        "target": args.target,
        "simulated_capacity_rps": capacity,
        "tolerance": args.tolerance,
        "all_agree": all(a.agrees for a in agreements),
        "rates": [
            {
                **agreement.to_dict(),
                "live": live,
                "simulated_refit_attainment": None if refit_sim is None else refit_sim.attainment,
                "simulated": dataclasses.asdict(sim),
                "simulated_refit": None if refit_sim is None else dataclasses.asdict(refit_sim),
                "wall_s": wall_s,
            }
            for agreement, (_, live, sim, _, wall_s), refit_sim in zip(
                agreements, points, refit_sims, strict=True
            )
        ],
    }


def format_report(report: dict) -> str:
    """The per-rate table."""
    lines = [
        f"{report['server']}: {report['mode']} ({report['instances']}), {report['model']}, "
        f"policy {report['policy']}, profile {report['profile']}",
        f"SLOs: TTFT <= {report['ttft_slo_s'] * 1e3:.1f} ms, TBT <= "
        f"{report['tbt_slo_s'] * 1e3:.2f} ms; simulated capacity at {report['target']:.0%}: "
        f"{report['simulated_capacity_rps']:.2f} req/s; {report['workload']['num_prompts']} "
        "requests per rate",
        "| req/s | live | simulated | live - sim | agrees | sim, refit profile | live TTFT p50 / "
        "p99 ms | sim TTFT p50 / p99 ms | live TPOT mean ms | sim TBT mean ms |",
        "| ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["rates"]:
        live, sim = row["live"], row["simulated"]
        refit = row["simulated_refit_attainment"]
        refit = "n/a" if refit is None else f"{refit:.3f}"
        lines.append(
            f"| {row['rate_rps']:.2f} | {row['live_attainment']:.3f} | "
            f"{row['simulated_attainment']:.3f} | {row['difference']:+.3f} | "
            f"{'yes' if row['agrees'] else 'NO'} | {refit} | {live['median_ttft_ms']:.1f} / "
            f"{live['p99_ttft_ms']:.1f} | {sim['ttft_p50_s'] * 1e3:.1f} / "
            f"{sim['ttft_p99_s'] * 1e3:.1f} | {live['mean_tpot_ms']:.2f} | "
            f"{sim['tbt_mean_s'] * 1e3:.2f} |"
        )
    verdict = "agree" if report["all_agree"] else "DISAGREE"
    lines.append(f"live and simulated attainment {verdict} within {report['tolerance']:g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except (
        TargetUnreachableError,
        WorkloadError,
        live_shape.LiveCapacityError,
        ProfileError,
        RouterConfigError,
        TraceFormatError,
        OSError,
    ) as error:
        print(f"halfmoon bench live-capacity: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return 0
