"""`halfmoon bench live-capacity`: the capacity simulator checked against a running cluster.

The same requests (lengths, prompts' block structure, arrival times) go to the live cluster
through `bench serve`'s load generator and to the simulator `bench capacity` uses (request-level
disaggregated simulation, or colocated continuous batching), set up as the cluster is: its mode,
its instance counts, its router settings and its profile (measured from its workers at start and
refit online, as `GetServerInfo` reports it). Per rate: the share of requests within both SLOs,
live and simulated, and whether they agree within a tolerance.
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
from dataclasses import dataclass

import numpy as np

from halfmoon.cluster.bench import serve as bench_serve
from halfmoon.cluster.bench.metrics import summarize
from halfmoon.cluster.bench.targets import TargetUnreachableError, make_target
from halfmoon.cluster.bench.workload import (
    BenchRequest,
    WorkloadError,
    add_random_length_options,
    scale_records,
)
from halfmoon.cluster.client.grpc_client import Client, ServerError
from halfmoon.cluster.config import EngineSection
from halfmoon.router.config import RouterConfig
from halfmoon.router.errors import ProfileError, RouterConfigError, TraceFormatError
from halfmoon.router.profile import Profile, load_profile, profile_from_dict
from halfmoon.router.sim.capacity import MAX_SCALE, highest_passing
from halfmoon.router.sim.colocated_simulation import ColocatedSimulation
from halfmoon.router.sim.simulation import Simulation
from halfmoon.router.sim.summary import percentile
from halfmoon.router.sim.trace import TraceRecord, read_trace

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
DEFAULT_FRACTIONS = (0.5, 1.0, 1.5)
# Rates are judged against this share of requests within both SLOs when they are picked as
# fractions of the simulated capacity (Mooncake's definition of capacity).
DEFAULT_TARGET = 0.9
# Default SLOs, as multiples of the profile's unloaded times for the workload's mean request
# (Mooncake's 30 s TTFT and 100-300 ms TBT are loose multiples of a 70B model's; these keep the
# same shape for whatever model the cluster serves, a tiny one on CPU included).
TTFT_SLO_X, TBT_SLO_X = 10.0, 5.0
WARMUP_REQUESTS = 2
WARMUP_SEED = 1_000_003  # far from the runs' seeds, so warm-up prompts share no prefix with them


class LiveCapacityError(ValueError):
    """The server cannot be mirrored by the simulator; the message names the fix."""


@dataclass(slots=True)
class ClusterShape:
    """What the simulator copies from a live cluster."""

    mode: str
    num_prefill: int
    num_decode: int
    router: RouterConfig
    profile: Profile
    model: str

    @property
    def instances(self) -> str:
        if self.mode == COLOCATED:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"


@dataclass(slots=True)
class Agreement:
    """Live against simulated attainment at one rate."""

    rate_rps: float
    live: float
    simulated: float
    tolerance: float

    @property
    def difference(self) -> float:
        return self.live - self.simulated

    @property
    def agrees(self) -> bool:
        return abs(self.difference) <= self.tolerance + 1e-12

    def to_dict(self) -> dict:
        return {
            "rate_rps": self.rate_rps,
            "live_attainment": self.live,
            "simulated_attainment": self.simulated,
            "difference": self.difference,
            "agrees": self.agrees,
        }


def compare(
    rates: list[float], live: list[float], simulated: list[float], tolerance: float
) -> list[Agreement]:
    """One Agreement per rate."""
    if not len(rates) == len(live) == len(simulated):
        raise ValueError(f"{len(rates)} rates but {len(live)} live, {len(simulated)} simulated")
    return [Agreement(*row, tolerance) for row in zip(rates, live, simulated, strict=True)]


def rates_from_capacity(capacity_rps: float, fractions: tuple[float, ...]) -> list[float]:
    """The rates to run: fractions of the simulated capacity."""
    if capacity_rps <= 0:
        raise LiveCapacityError(
            "the simulator misses the SLOs even at the lowest rate: loosen --ttft-slo / "
            "--tbt-slo, or pass --rates"
        )
    if math.isinf(capacity_rps):
        raise LiveCapacityError(
            "the simulator meets the SLOs even with every request sent at once: tighten "
            "--ttft-slo / --tbt-slo, send more --num-prompts, or pass --rates"
        )
    return [capacity_rps * f for f in fractions]


def default_slos(
    shape: ClusterShape, mean_prompt: float, mean_output: float
) -> tuple[float, float]:
    """TTFT and TBT SLOs as TTFT_SLO_X and TBT_SLO_X times the profile's unloaded figures for
    the mean request: its prefill, the fixed per-request overhead and (disaggregated) its KV
    transfer, and a decode step of one sequence. The hand-off the router refits under load is
    left out, so the SLOs of a cluster do not drift with the load it has seen."""
    profile = shape.profile
    ttft = profile.request_overhead_s + profile.cost.prefill_time(mean_prompt, 0)
    if shape.mode == DISAGGREGATED:
        ttft += profile.transfer_time(int(mean_prompt))
    tbt = profile.cost.decode_step_time(1, mean_prompt + mean_output / 2)
    return TTFT_SLO_X * ttft, TBT_SLO_X * tbt


def shape_from_server(
    details: dict, mode: str, model: str, profile: Profile | None
) -> ClusterShape:
    """The cluster as `GetServerInfo` describes it; `profile` (from --profile) wins over the
    server's. Every field is checked: it comes from the network."""
    if mode not in (DISAGGREGATED, COLOCATED):
        raise LiveCapacityError(
            f"the server's mode {mode!r} is neither {DISAGGREGATED} nor {COLOCATED}"
        )
    workers = details.get("workers")
    if not isinstance(workers, dict):
        raise LiveCapacityError("the server's info lists no workers; is it a halfmoon cluster?")
    counts = {"prefill": 0, "decode": 0}
    for load in workers.values():
        if not isinstance(load, dict) or load.get("dead") or load.get("draining"):
            continue
        if load.get("kind") in counts:
            counts[load["kind"]] += 1
    if counts["decode"] < 1 or (mode == DISAGGREGATED and counts["prefill"] < 1):
        raise LiveCapacityError(f"the server has no live worker of a kind it needs: {counts}")
    router = details.get("router")
    if not isinstance(router, dict):
        raise LiveCapacityError(
            "the server does not report its router settings (GetServerInfo `router`); it is older "
            "than this client: upgrade it"
        )
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    try:
        config = RouterConfig(**{k: v for k, v in router.items() if k in names})
    except (RouterConfigError, TypeError) as error:
        raise LiveCapacityError(f"the server's router settings are invalid: {error}") from None
    if profile is None:
        if "profile" not in details:
            raise LiveCapacityError("the server does not report its profile; pass --profile FILE")
        try:
            profile = profile_from_dict(details["profile"], "from the server")
        except (ProfileError, TypeError, ValueError, KeyError, AttributeError) as error:
            raise LiveCapacityError(f"the server's profile is invalid: {error}") from None
    return ClusterShape(mode, counts["prefill"], counts["decode"], config, profile, model)


def to_records(
    requests: list[BenchRequest], hash_ids: list[list[int]] | None, block_size: int
) -> list[TraceRecord]:
    """The simulator's view of the requests sent: same lengths and arrival times; hash ids from
    the trace, or (random prompts, which share nothing) fresh ones per `block_size` tokens."""
    records, next_id = [], 0
    for i, request in enumerate(requests):
        if hash_ids is not None:
            ids = list(hash_ids[i])
        else:
            count = math.ceil(len(request.prompt_token_ids) / block_size)
            ids, next_id = list(range(next_id, next_id + count)), next_id + count
        records.append(
            TraceRecord(
                i + 1, request.arrival_s, len(request.prompt_token_ids), request.max_tokens, ids
            )
        )
    return records


@dataclass(slots=True)
class SimFigures:
    """One simulated run: attainment and the latencies behind it."""

    attainment: float
    rejected: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p99_s: float


def simulate(
    shape: ClusterShape,
    records: list[TraceRecord],
    block_size: int,
    max_batched_tokens: int,
    slos: tuple[float, float],
) -> SimFigures:
    """The records on the simulated cluster; the attainment is judged as `bench capacity` judges
    it (TTFT and TBT, a request's decode time over its decoded tokens; rejected ones miss)."""
    router = dataclasses.replace(shape.router, block_size=block_size)
    cache_blocks = shape.profile.cache_blocks(block_size)
    if shape.mode == DISAGGREGATED:
        sim = Simulation(router, shape.profile, shape.num_prefill, shape.num_decode, cache_blocks)
    else:  # the live colocated router picks the least loaded worker and admits everything
        router = dataclasses.replace(router, policy="least_loaded", admission="none")
        sim = ColocatedSimulation(
            router, shape.profile, shape.num_decode, cache_blocks, max_batched_tokens
        )
    sim.run(records, progress=False)
    ttft, tbt = sim.latencies()
    ttft_slo, tbt_slo = slos
    served = np.isfinite(ttft)
    ttfts = sorted(ttft[served].tolist()) or [0.0]
    tbts = sorted(tbt[served].tolist()) or [0.0]
    return SimFigures(
        float(np.mean((ttft <= ttft_slo) & (tbt <= tbt_slo))),
        float(np.mean(~served)),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        statistics.fmean(tbts),
        percentile(tbts, 0.99),
    )


def simulated_capacity(
    shape: ClusterShape,
    records: list[TraceRecord],
    block_size: int,
    max_batched_tokens: int,
    slos: tuple[float, float],
    target: float,
) -> float:
    """The highest rate (req/s) at which the simulator meets the SLOs for `target` of these
    requests, their arrivals scaled (bisection, within 5 %); inf when they meet them even all
    at once."""
    span = records[-1].arrival_s - records[0].arrival_s
    base_rps = (len(records) - 1) / span if span > 0 else float(len(records))

    def passes(scale: float) -> bool:
        scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in records]
        return simulate(shape, scaled, block_size, max_batched_tokens, slos).attainment >= target

    scale = highest_passing(passes, 1.0, 0.05)
    return math.inf if scale >= MAX_SCALE else scale * base_rps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="halfmoon bench live-capacity",
        description="Check the capacity simulator against a running cluster: send the same "
        "workload at three rates with `bench serve`'s load generator, simulate it with the "
        "cluster's own mode, instance counts, router settings and profile (from GetServerInfo: "
        "measured from its workers at start, refit online; or --profile), and print per rate the "
        "share of requests within both SLOs (TTFT and TBT = decode time per decoded token; "
        "failed or rejected requests miss), live and simulated, and whether they agree within "
        "--tolerance. Exit status 2 when the server cannot be reached or mirrored.",
    )
    where = parser.add_argument_group("server")
    where.add_argument(
        "--server", default=bench_serve.DEFAULT_GRPC, help="gRPC server HOST:PORT (%(default)s)"
    )
    serve_defaults = bench_serve.build_parser().parse_args([])
    where.add_argument(
        "--api-key",
        default=serve_defaults.api_key,
        help="the server's API key (default: as `bench serve`: $HALFMOON_API_KEY, else "
        "$OPENAI_API_KEY)",
    )
    where.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (%(default)s)"
    )
    work = parser.add_argument_group("workload (as `bench serve`)")
    work.add_argument("--num-prompts", type=int, default=48, help="requests per rate (%(default)s)")
    work.add_argument("--trace", help="Mooncake-format JSONL trace; without it, random lengths")
    work.add_argument(
        "--block-tokens",
        type=int,
        default=serve_defaults.block_tokens,
        help="tokens per trace hash id (%(default)s)",
    )
    add_random_length_options(work)
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the first rate's prompts and arrivals; rate i uses seed + i, so no rate "
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
    rates.add_argument(
        "--ttft-slo",
        type=float,
        help=f"TTFT SLO, seconds (default: {TTFT_SLO_X:g}x the profile's unloaded TTFT of the "
        "mean request: prefill, per-request overhead and KV transfer)",
    )
    rates.add_argument(
        "--tbt-slo",
        type=float,
        help=f"TBT SLO, seconds (default: {TBT_SLO_X:g}x the profile's decode step of one "
        "sequence at the mean context)",
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
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars on stderr")
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


def fetch_shape(args) -> ClusterShape:
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
    return shape_from_server(info.details, info.mode, info.model, profile)


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
        raise LiveCapacityError(
            f"--target {args.target} must be in (0, 1], --tolerance {args.tolerance} in [0, 1) "
            f"and --num-prompts {args.num_prompts} >= 2"
        )
    shape = fetch_shape(args)
    tokenizer, vocabulary = bench_serve.load_vocabulary(None)
    block_size = args.block_tokens if args.trace else shape.router.block_size
    base, hash_ids = make_requests(args, 1.0, args.seed, vocabulary)
    mean_prompt = statistics.fmean(len(r.prompt_token_ids) for r in base)
    mean_output = statistics.fmean(r.max_tokens for r in base)
    slo_ttft, slo_tbt = default_slos(shape, mean_prompt, mean_output)
    args.ttft_slo = args.ttft_slo or slo_ttft
    args.tbt_slo = args.tbt_slo or slo_tbt
    slos = (args.ttft_slo, args.tbt_slo)
    capacity = simulated_capacity(
        shape, to_records(base, hash_ids, block_size), block_size, args.max_batched_tokens,
        slos, args.target,
    )  # fmt: skip
    rates = list(args.rates) if args.rates else rates_from_capacity(capacity, args.fractions)
    warm, _ = make_requests(args, math.inf, WARMUP_SEED, vocabulary, WARMUP_REQUESTS)
    run_live(args, warm, vocabulary, tokenizer, math.inf, WARMUP_SEED)
    points = []
    for i, rate in enumerate(rates):
        seed = args.seed + i
        requests, hash_ids = make_requests(args, rate, seed, vocabulary)
        started = time.perf_counter()
        live = run_live(args, requests, vocabulary, tokenizer, rate, seed)
        records = to_records(requests, hash_ids, block_size)
        sim = simulate(shape, records, block_size, args.max_batched_tokens, slos)
        points.append((rate, live, sim, records, time.perf_counter() - started))
    # The server's profile once its router has refit it online from the steps just run: how
    # much of a gap the profile explains (what is left is queueing, transfer, overheads).
    refit = None if args.profile else fetch_shape(args)
    refit_sims = [
        None if refit is None else simulate(refit, p[3], block_size, args.max_batched_tokens, slos)
        for p in points
    ]
    agreements = compare(
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
        TargetUnreachableError, WorkloadError, LiveCapacityError, ProfileError,
        RouterConfigError, TraceFormatError, OSError,
    ) as error:  # fmt: skip
        print(f"halfmoon bench live-capacity: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return 0
