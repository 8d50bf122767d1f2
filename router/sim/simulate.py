"""`halfmoon simulate`: replay a trace through the Conductor on simulated instances."""

from __future__ import annotations

import argparse
import json
import sys

from halfmoon.router.config import ADMISSION_MODES, POLICY_NAMES, RouterConfig
from halfmoon.router.errors import RouterConfigError, TraceFormatError
from halfmoon.router.profile import DEFAULT_PROFILE, Profile, load_profile
from halfmoon.router.sim.simulation import SimInstances
from halfmoon.router.sim.step_simulation import make_simulation
from halfmoon.router.sim.summary import SimSummary
from halfmoon.router.sim.trace import TraceRecord, read_trace

# The replication knobs' flags: each defaults to, and sets, the RouterConfig field named.
REPLICATION_FLAGS = (
    ("--replicate-min-hits", "replicate_min_hits", "recent requests that make a prefix hot"),
    (
        "--replicate-max-copies",
        "replicate_max_copies",
        "no copy once this many prefill instances hold the prefix",
    ),
    (
        "--replicate-margin",
        "replicate_margin_s",
        "seconds the target's queue must undercut the holders' queues by",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The simulate command's flags."""
    parser = argparse.ArgumentParser(
        prog="halfmoon simulate",
        description="Discrete-event simulation of the router on a Mooncake-format trace.",
    )
    parser.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    parser.add_argument("--prefill", type=int, required=True, help="prefill instances")
    parser.add_argument("--decode", type=int, required=True, help="decode instances")
    parser.add_argument("--policy", required=True, help=f"one of {', '.join(POLICY_NAMES)}")
    parser.add_argument("--admission", default="none", help=f"one of {', '.join(ADMISSION_MODES)}")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="cost-model profile YAML")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per trace hash id")
    parser.add_argument(
        "--cache-blocks-per-instance",
        type=int,
        default=None,
        help="blocks each prefill instance caches (default: the profile's cache bytes)",
    )
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds")
    parser.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO in seconds")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="replay speed-up: 2 halves every gap"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    parser.add_argument("--bypass-tokens", type=int, default=512, help="short-prompt bypass limit")
    defaults = RouterConfig()
    parser.add_argument(
        "--replicate",
        action=argparse.BooleanOptionalAction,
        default=defaults.replicate,
        help="copy hot prefixes toward idle prefill instances (RouterConfig.replicate)",
    )
    for flag, field, help_ in REPLICATION_FLAGS:
        default = getattr(defaults, field)
        parser.add_argument(flag, type=type(default), default=default, help=help_)
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget of each simulated engine, used when the profile's engine "
        "prefills in chunks (prefill.chunk_tokens > 0): then every instance is stepped like "
        "the engine (step_simulation.py)",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run least_loaded on the same trace, to report the share of the possible "
        "gain (least_loaded down to the cache-limit bound) the policy reached",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--on-bad-line", choices=("skip", "fail"), default="skip")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def simulate(args: argparse.Namespace) -> SimSummary:
    """Run one simulation from parsed flags (and, with `--baseline`, the same under
    least_loaded for the share of the possible gain)."""
    check_flags(args)
    profile = load_profile(args.profile)
    cache_blocks = args.cache_blocks_per_instance
    if cache_blocks is None:
        cache_blocks = profile.cache_blocks(args.block_size)
    if cache_blocks < 0:
        raise RouterConfigError(f"--cache-blocks-per-instance {cache_blocks} must be >= 0")
    records, bad = read_trace(args.trace, args.time_scale, args.on_bad_line)
    summary = run_policy(args, args.policy, profile, cache_blocks, records)
    summary.bad_lines = len(bad)
    if args.baseline:
        baseline = summary
        if args.policy != "least_loaded":
            baseline = run_policy(args, "least_loaded", profile, cache_blocks, records)
        summary.set_baseline(baseline.ttft_mean_s)
    return summary


def check_flags(args: argparse.Namespace) -> None:
    """Raise a RouterConfigError naming the first impossible flag."""
    if args.prefill < 1 or args.decode < 1:
        raise RouterConfigError(
            f"--prefill {args.prefill} --decode {args.decode}: need at least one of each"
        )
    if args.max_batched_tokens < 1:
        raise RouterConfigError(f"--max-batched-tokens {args.max_batched_tokens} must be >= 1")
    if not args.time_scale > 0:
        raise RouterConfigError(f"--time-scale {args.time_scale} must be a positive factor")


def run_policy(
    args: argparse.Namespace,
    policy: str,
    profile: Profile,
    cache_blocks: int,
    records: list[TraceRecord],
) -> SimSummary:
    """One simulation of `records` under `policy`, every other setting from the flags."""
    config = RouterConfig(
        policy=policy,
        admission=args.admission,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        block_size=args.block_size,
        bypass_max_tokens=args.bypass_tokens,
        seed=args.seed,
        replicate=args.replicate,
        replicate_min_hits=args.replicate_min_hits,
        replicate_max_copies=args.replicate_max_copies,
        replicate_margin_s=args.replicate_margin,
    )
    instances = SimInstances(
        profile, args.prefill, args.decode, cache_blocks, args.max_batched_tokens
    )
    simulation = make_simulation(config, instances)
    return simulation.run(records, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `halfmoon simulate`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        summary = simulate(args)
    except (RouterConfigError, TraceFormatError, OSError) as exc:
        print(f"halfmoon simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary.to_dict()))
    else:
        print(summary.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
