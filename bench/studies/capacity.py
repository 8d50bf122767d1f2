"""`halfmoon bench capacity`: Mooncake's effective request capacity, disaggregated vs colocated,
in the simulator."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from halfmoon.bench.options import bench_parser
from halfmoon.router.degree import profile_at_degree
from halfmoon.router.errors import ProfileError, RouterConfigError, TraceFormatError
from halfmoon.router.profile import DEFAULT_PROFILE, load_profile
from halfmoon.router.sim.capacity import COLOCATED, DISAGGREGATED, Capacity, ModeSweep, Setup, sweep
from halfmoon.router.sim.colocated_simulation import COLOCATED_ADMISSION, COLOCATED_POLICIES
from halfmoon.router.sim.splits import Split, parse_split
from halfmoon.router.sim.trace import read_trace

DESCRIPTION = """\
Effective request capacity (Mooncake, FAST'25): the highest arrival rate at which at least
--target of the requests meet both SLOs (TTFT <= --ttft-slo and TBT <= each --tbt-slos
threshold; TBT is a request's decode time over its decoded tokens; a rejected request misses).

The trace's arrival times are divided by a rate factor; the highest factor that passes is found
by bisection (doubling or halving from 1 to bracket it, then to within --tolerance), for:
  disaggregated  the Conductor on N prefill instances of P GPUs + M decode instances of D GPUs,
                 for each N@P+M@D of --splits (N+M: both at the profile's own degree; halfmoon
                 simulate's request-level simulation, --admission against the TTFT SLO); the
                 best split counts, as a deployment picks its prefill:decode ratio and degrees;
  colocated      the same GPUs as instances of --colocated-degree GPUs that each prefill and
                 decode in one continuous batch (chunked prefill under --max-batched-tokens per
                 step, local prefix cache, as vLLM runs), for each --colocated-routing
                 (least-loaded, local-cache-aware); the best routing counts;
                 --colocated-admission (default none: vLLM queues every request).
Every instance is timed by the same profile's cost model, scaled from the profile's degree to
its own (router/degree.py: each doubling of the GPUs 2 x 0.85 times faster, KV capacity what
the GPUs hold beside the weights, host cache and network shared by GPU), so a prefill chunk
lengthens the decode step it shares. Every run is judged at every TBT threshold, so the
bisections share runs. Prints a table with the ratio; --json adds every run's attainment per
rate, --plot draws attainment against rate.
"""


def parse_floats(text: str) -> tuple[float, ...]:
    """`0.1,0.2,0.3` as positive floats."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive numbers")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The capacity bench's flags."""
    parser = bench_parser(
        "capacity",
        DESCRIPTION,
        json=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    parser.add_argument(
        "--profile",
        default=str(DEFAULT_PROFILE),
        help="cost-model profile YAML (default: %(default)s)",
    )
    parser.add_argument(
        "--splits",
        default="12+4,13+3,14+2",
        help="comma-separated disaggregated splits N@P+M@D (N prefill instances of P GPUs + M "
        "decode instances of D GPUs, e.g. 2@4+4@2; N+M: both at the profile's own degree), all "
        "on the same N x P + M x D GPUs (default: %(default)s)",
    )
    parser.add_argument(
        "--colocated-degree",
        type=int,
        default=None,
        help="GPUs of each colocated instance; the splits' GPUs / this many instances (default: "
        "the profile's own degree)",
    )
    parser.add_argument(
        "--ttft-slo", type=float, default=30.0, help="TTFT SLO, seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--tbt-slos",
        type=parse_floats,
        default=(0.1, 0.2, 0.3),
        help="comma-separated TBT thresholds, seconds (default: 0.1,0.2,0.3)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="fraction of requests that must meet both SLOs (default: %(default)s)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="bisection stops within this relative gap (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="tokens per trace hash id (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-blocks-per-instance",
        type=int,
        default=None,
        help="prefix-cache blocks of each prefill or colocated instance (default: the profile's "
        "cache bytes at the instance's degree)",
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="colocated engines' token budget per step, decode tokens + prefill chunk "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--colocated-routing",
        default=",".join(COLOCATED_POLICIES),
        help="comma-separated colocated routings to try; the best counts (default: %(default)s)",
    )
    parser.add_argument(
        "--admission",
        choices=("none", "early_rejection"),
        default="early_rejection",
        help="disaggregated admission: early_rejection (Mooncake's) rejects a request at arrival "
        "when its predicted TTFT breaks --ttft-slo; under none only a full decode KV rejects "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--colocated-admission",
        choices=COLOCATED_ADMISSION,
        default="none",
        help="colocated admission, the same rule on the chosen instance (default: %(default)s)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="use only the first N requests of the trace"
    )
    parser.add_argument(
        "--at-rates",
        type=parse_floats,
        default=(),
        help="also simulate every mode at these rates (req/s), e.g. the rates of a live sweep",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the results as JSON to FILE (no FILE: to stdout instead of the table)",
    )
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="plot attainment vs rate")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def make_setup(args: argparse.Namespace) -> tuple[Setup, tuple[str, ...]]:
    """Validate the flags and load the trace and profile."""
    if not 0 < args.target <= 1:
        raise RouterConfigError(f"--target {args.target} must be a fraction in (0, 1]")
    if not 0 < args.tolerance < 1:
        raise RouterConfigError(f"--tolerance {args.tolerance} must be in (0, 1)")
    if args.ttft_slo <= 0 or args.max_batched_tokens < 1 or args.block_size < 1:
        raise RouterConfigError(
            "--ttft-slo, --max-batched-tokens and --block-size must be positive"
        )
    policies = tuple(p.strip() for p in args.colocated_routing.split(",") if p.strip())
    unknown = [p for p in policies if p not in COLOCATED_POLICIES]
    if unknown or not policies:
        raise RouterConfigError(
            f"--colocated-routing {args.colocated_routing!r}: choose from "
            f"{', '.join(COLOCATED_POLICIES)}"
        )
    profile = load_profile(args.profile)
    splits = parse_splits(args.splits, profile.tensor_parallel_size)
    records, _ = read_trace(args.trace)
    if args.requests is not None:
        if args.requests < 2:
            raise RouterConfigError(f"--requests {args.requests} must be at least 2")
        records = records[: args.requests]
    if len(records) < 2:
        raise RouterConfigError(f"trace {args.trace} has {len(records)} requests; need 2")
    cache_blocks = args.cache_blocks_per_instance
    if cache_blocks is not None and cache_blocks < 0:
        raise RouterConfigError(f"--cache-blocks-per-instance {cache_blocks} must be >= 0")
    setup = Setup(
        records,
        profile,
        splits,
        cache_blocks,
        args.block_size,
        args.max_batched_tokens,
        args.ttft_slo,
        tuple(sorted(args.tbt_slos)),
        args.target,
        args.admission,
        args.colocated_admission,
        args.colocated_degree,
    )
    check_degrees(setup)
    return setup, policies


def parse_splits(text: str, degree: int) -> tuple[Split, ...]:
    """`12+4,2@4+4@2` as splits (N+M: both at `degree`); every split needs >= 1 instance of
    each role, degrees >= 1, and the same GPUs (N x P + M x D) as the others."""
    try:
        splits = tuple(parse_split(part, degree) for part in text.split(",") if part.strip())
    except ValueError:
        raise RouterConfigError(
            f"--splits {text!r}: write N+M or N@P+M@D pairs such as 13+3,2@4+4@2"
        ) from None
    if not splits or any(min(s.num_prefill, s.num_decode) < 1 for s in splits):
        raise RouterConfigError(f"--splits {text!r}: every split needs >= 1 prefill and decode")
    if any(min(s.prefill_degree, s.decode_degree) < 1 for s in splits):
        raise RouterConfigError(f"--splits {text!r}: every degree must be >= 1")
    if len({s.num_gpus for s in splits}) != 1:
        gpus = ", ".join(f"{s.name} = {s.num_gpus}" for s in splits)
        raise RouterConfigError(
            f"--splits {text!r}: every split must use the same GPUs N x P + M x D ({gpus})"
        )
    return splits


def check_degrees(setup: Setup) -> None:
    """Every split's and the colocated instances' degrees divide the GPUs and hold the weights
    (a RouterConfigError or ProfileError naming the split or flag that does not)."""
    degree = setup.colocated_degree
    if degree < 1 or setup.num_gpus % degree:
        raise RouterConfigError(
            f"--colocated-degree {degree}: the splits' {setup.num_gpus} GPUs are not a whole "
            f"number of colocated instances of {degree} GPUs"
        )
    for split in setup.splits:
        try:
            split.profile(setup.profile)
        except ProfileError as error:
            raise ProfileError(f"split {split.name}: {error}") from None
    try:
        profile_at_degree(setup.profile, degree)
    except ProfileError as error:
        raise ProfileError(f"--colocated-degree {degree}: {error}") from None


def table(setup: Setup, capacities: list[Capacity]) -> str:
    """Markdown table: best capacity of each side at each TBT threshold and the ratio."""
    colocated = f"{setup.num_colocated} x TP{setup.colocated_degree}"
    lines = [
        f"| TBT SLO | disaggregated req/s (best split) | colocated {colocated} req/s "
        "(best routing) | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for cap in capacities:
        (dis, dis_rps), (col, col_rps) = cap.best(DISAGGREGATED), cap.best(COLOCATED)
        lines.append(
            f"| {cap.tbt_slo_s * 1e3:g} ms | {dis_rps:.2f} ({dis.split('/')[1]}) "
            f"| {col_rps:.2f} ({col.split('/')[1]}) | {cap.ratio:.2f} |"
        )
    return "\n".join(lines)


def report(
    args: argparse.Namespace, setup: Setup, capacities: list[Capacity], sweeps, wall_s: float
) -> dict:
    """Everything as one JSON-ready dict."""
    return {
        "trace": str(args.trace),
        "profile": setup.profile.name,
        "requests": len(setup.records),
        "gpus": setup.num_gpus,
        "splits": [split_info(setup, split) for split in setup.splits],
        "colocated": colocated_info(setup),
        "max_batched_tokens": setup.max_batched_tokens,
        "ttft_slo_s": setup.ttft_slo_s,
        "admission": setup.admission,
        "colocated_admission": setup.colocated_admission,
        "target": setup.target,
        "base_rate_rps": setup.base_rate_rps,
        "capacity": [
            {
                "tbt_slo_ms": cap.tbt_slo_s * 1e3,
                "rps": cap.by_mode,
                "disaggregated": dict(zip(("mode", "rps"), cap.best(DISAGGREGATED), strict=True)),
                "colocated": dict(zip(("mode", "rps"), cap.best(COLOCATED), strict=True)),
                "ratio": cap.ratio,
            }
            for cap in capacities
        ],
        "runs": {
            mode: [runs.points[s].to_dict() for s in sorted(runs.points)]
            for mode, runs in sweeps.items()
        },
        "wall_s": wall_s,
    }


def split_info(setup: Setup, split: Split) -> dict:
    """A split's instances, degrees and the profile that times them, for the JSON."""
    profile = split.profile(setup.profile)
    return {
        "name": split.name,
        "prefill": split.num_prefill,
        "prefill_degree": split.prefill_degree,
        "decode": split.num_decode,
        "decode_degree": split.decode_degree,
        "profile": profile.name,
        "cache_blocks_per_prefill": setup.cache_blocks_of(profile),
        "decode_kv_capacity_tokens": profile.decode_kv_capacity_tokens,
    }


def colocated_info(setup: Setup) -> dict:
    """The colocated instances, their degree and the profile that times them, for the JSON."""
    profile = setup.colocated_profile
    return {
        "instances": setup.num_colocated,
        "degree": setup.colocated_degree,
        "profile": profile.name,
        "cache_blocks_per_instance": setup.cache_blocks_of(profile),
        "kv_capacity_tokens": profile.decode_kv_capacity_tokens,
    }


def plot(path: str, setup: Setup, sweeps: dict[str, ModeSweep], capacities) -> None:
    """Attainment against rate, one panel per TBT threshold, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = setup.tbt_slos_s
    fig, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
    for ax, cap in zip(axes[0], capacities, strict=True):
        for mode, runs in sweeps.items():
            points = [runs.points[s] for s in sorted(runs.points)]
            rates = [p.rate_rps for p in points]
            ax.plot(rates, [p.attainment[cap.tbt_slo_s] for p in points], marker=".", label=mode)
        ax.axhline(setup.target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"TBT <= {cap.tbt_slo_s * 1e3:g} ms: ratio {cap.ratio:.2f}")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"requests within SLOs (TTFT <= {setup.ttft_slo_s:g} s)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `halfmoon bench capacity`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        setup, policies = make_setup(args)
    except (RouterConfigError, TraceFormatError, ProfileError, OSError) as exc:
        print(f"halfmoon bench capacity: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    bar = tqdm(unit="run", disable=args.no_progress, desc="simulated runs")
    capacities, sweeps = sweep(setup, policies, args.tolerance, args.at_rates, lambda: bar.update())
    bar.close()
    result = report(args, setup, capacities, sweeps, time.perf_counter() - started)
    if args.json == "-":
        print(json.dumps(result))
    else:
        print(
            f"{Path(args.trace).name}, {len(setup.records)} requests at "
            f"{setup.base_rate_rps:.2f} req/s, profile {setup.profile.name}, "
            f"{setup.num_gpus} GPUs, TTFT <= {setup.ttft_slo_s:g} s, {setup.target:.0%} of "
            "requests"
        )
        print(table(setup, capacities))
        print(f"{sum(len(s.points) for s in sweeps.values())} runs in {result['wall_s']:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(args.plot, setup, sweeps, capacities)
    return 0


if __name__ == "__main__":
    sys.exit(main())
