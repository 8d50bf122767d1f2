"""`python -m halfmoon.bench.studies.router_report`: regenerate docs/router.md from
simulations and the router bench."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from halfmoon.bench.studies import router as bench
from halfmoon.router.config import ADMISSION_MODES, POLICY_NAMES, RouterConfig
from halfmoon.router.profile import DEFAULT_PROFILE, load_profile
from halfmoon.router.sim.cache_bound import gain_share
from halfmoon.router.sim.simulation import SimInstances, Simulation
from halfmoon.router.sim.summary import SimSummary
from halfmoon.router.sim.trace import read_trace

REPO = Path(__file__).resolve().parents[2]
TRACES = Path("/work/shared/traces")
MOONCAKE_TTFT_S = {
    "conductor": "3.07 (global cache-aware)",
    "cache_aware_local": "3.58 (local cache-aware)",
    "least_loaded": "5.27 (load-balancing)",
    "random": "19.65",
}


@dataclass(slots=True)
class Setup:
    """One trace and the cluster size, replay speed and SLOs it is simulated at."""

    trace: str
    prefill: int
    decode: int
    time_scale: float
    ttft_slo_s: float | None = 30.0
    tbt_slo_s: float | None = 0.04

    def command(self, policy: str, admission: str) -> str:
        """The `halfmoon simulate` command that reproduces one row."""
        return (
            f"halfmoon simulate --trace {TRACES / self.trace} --prefill {self.prefill} "
            f"--decode {self.decode} --policy {policy} --admission {admission} "
            f"--time-scale {self.time_scale} --ttft-slo {self.ttft_slo_s} "
            f"--tbt-slo {self.tbt_slo_s}"
        )


SETUPS = (
    Setup("conversation_trace.jsonl", prefill=12, decode=2, time_scale=1.5),
    Setup("synthetic_trace.jsonl", prefill=8, decode=2, time_scale=1.0, tbt_slo_s=0.025),
)
# The scaling table: N prefill + N decode instances, the traces as recorded, no SLO, every
# router setting at its default (the same for every size and both traces).
SCALING_SIZES = (8, 16, 32)
SCALING_POLICIES = ("conductor", "least_loaded", "random")
# The goals: conductor / least_loaded and conductor / random mean TTFT at most these
# where the cache-limit bound allows it; elsewhere this share of the possible gain.
LEAST_LOADED_GOAL, RANDOM_GOAL, SHARE_GOAL = 0.6, 0.2, 0.9


def simulate(setup: Setup, policy: str, admission: str, traces: Path) -> SimSummary:
    """One simulation of `setup` with the A800 profile and its default cache size."""
    profile = load_profile(DEFAULT_PROFILE)
    records, _ = read_trace(traces / setup.trace, setup.time_scale)
    config = RouterConfig(
        policy=policy,
        admission=admission,
        ttft_slo_s=setup.ttft_slo_s,
        tbt_slo_s=setup.tbt_slo_s,
        block_size=512,
    )
    instances = SimInstances(profile, setup.prefill, setup.decode, profile.cache_blocks(512))
    simulation = Simulation(config, instances)
    return simulation.run(records, progress=False)


def table(setup: Setup, results: dict[tuple[str, str], SimSummary]) -> list[str]:
    """Markdown rows of every policy x admission mode for one setup."""
    rows = [
        "| policy | admission | mean TTFT s | p50 | p90 | p99 | mean TBT ms | p99 TBT ms "
        "| SLO met | rejected | hit rate (bound) | Mooncake mean TTFT s | wall s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for (policy, admission), s in results.items():
        published = MOONCAKE_TTFT_S.get(policy, "-") if admission == "none" else ""
        if "conversation" not in setup.trace:
            published = ""
        rows.append(
            f"| {policy} | {admission} | {s.ttft_mean_s:.2f} | {s.ttft_p50_s:.2f} "
            f"| {s.ttft_p90_s:.2f} | {s.ttft_p99_s:.1f} | {s.tbt_mean_s * 1e3:.1f} "
            f"| {s.tbt_p99_s * 1e3:.1f} | {s.slo_attainment:.1%} | {s.rejected} "
            f"| {s.hit_rate:.1%} ({s.hit_rate_unbounded:.1%}) | {published} | {s.wall_s:.1f} |"
        )
    return rows


def goals(results: dict[tuple[str, str], SimSummary]) -> list[str]:
    """The issue's goals checked against one setup's results."""
    conductor = results[("conductor", "none")].ttft_mean_s
    least = results[("least_loaded", "none")].ttft_mean_s
    rand = results[("random", "none")].ttft_mean_s
    early = results[("conductor", "early_rejection")]
    predicted = results[("conductor", "prediction_early_rejection")]
    hit = results[("conductor", "none")]
    return [
        f"- conductor / least_loaded mean TTFT = {conductor / least:.2f} (goal <= 0.6): "
        + ("met" if conductor <= 0.6 * least else "MISSED"),
        f"- conductor / random mean TTFT = {conductor / rand:.3f} (goal <= 0.2): "
        + ("met" if conductor <= 0.2 * rand else "MISSED"),
        f"- prediction-based early rejection rejects {predicted.rejected} vs {early.rejected} "
        f"at {predicted.slo_attainment:.1%} vs {early.slo_attainment:.1%} SLO attainment "
        "(goal: fewer rejections at equal or better attainment): "
        + (
            "met"
            if predicted.rejected < early.rejected
            and predicted.slo_attainment >= early.slo_attainment
            else "not met on this trace (see notes)"
        ),
        f"- conductor hit rate {hit.hit_rate:.1%} vs unbounded bound {hit.hit_rate_unbounded:.1%}"
        f" = {hit.hit_rate / hit.hit_rate_unbounded:.0%} of the bound (goal >= 90 %): "
        + ("met" if hit.hit_rate >= 0.9 * hit.hit_rate_unbounded else "MISSED"),
    ]


def setup_section(setup: Setup, traces: Path) -> list[str]:
    """The markdown section of one setup: every policy x admission mode, and the goals."""
    results = {}
    for policy in POLICY_NAMES:
        for admission in ADMISSION_MODES:
            results[(policy, admission)] = simulate(setup, policy, admission, traces)
            print(f"{setup.trace} {policy} {admission} done", file=sys.stderr)
    return [
        f"### {setup.trace}: {setup.prefill} prefill + {setup.decode} decode instances, "
        f"time scale {setup.time_scale}, SLO TTFT {setup.ttft_slo_s:g} s / TBT "
        f"{setup.tbt_slo_s * 1e3:g} ms",
        "",
        f"Reproduce one row: `{setup.command('conductor', 'none')}`",
        "",
        *table(setup, results),
        "",
        "Goals on this trace:",
        "",
        *goals(results),
        "",
    ]


def scaling_table(traces: Path) -> list[str]:
    """Conductor vs least_loaded and random at every size of SCALING_SIZES on both traces,
    beside the cache-limit bound, the share of the possible gain and the goals."""
    rows = [
        "| trace | instances | conductor s | least_loaded s | random s | cache bound s "
        "| conductor / least_loaded (bound) | conductor / random (bound) "
        "| share of the possible gain over least_loaded / random | goals |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for setup in SETUPS:
        for size in SCALING_SIZES:
            scaled = Setup(setup.trace, size, size, time_scale=1.0, ttft_slo_s=None, tbt_slo_s=None)
            results = {p: simulate(scaled, p, "none", traces) for p in SCALING_POLICIES}
            rows.append(scaling_row(scaled, results))
            print(f"{setup.trace} {size}P+{size}D done", file=sys.stderr)
    return rows


def scaling_row(setup: Setup, results: dict[str, SimSummary]) -> str:
    """One markdown row of the scaling table."""
    conductor, least, rand = (results[p].ttft_mean_s for p in SCALING_POLICIES)
    bound = results["conductor"].ttft_bound_mean_s
    shares = [gain_share(base, conductor, bound) for base in (least, rand)]
    verdicts = [
        goal_verdict(conductor, least, bound, LEAST_LOADED_GOAL),
        goal_verdict(conductor, rand, bound, RANDOM_GOAL),
    ]
    return (
        f"| {setup.trace.split('_')[0]} | {setup.prefill}P+{setup.decode}D | {conductor:.3f} "
        f"| {least:.3f} | {rand:.3f} | {bound:.3f} | {conductor / least:.3f} "
        f"({bound / least:.3f}) | {conductor / rand:.3f} ({bound / rand:.3f}) "
        f"| {' / '.join(_percent(s) for s in shares)} | {'; '.join(verdicts)} |"
    )


def goal_verdict(policy_s: float, baseline_s: float, bound_s: float, goal: float) -> str:
    """The ratio goal where the bound allows it (bound / baseline within `goal`), else the
    share of the possible gain: which one applies and whether it is met."""
    if bound_s <= goal * baseline_s:
        met = policy_s <= goal * baseline_s
        return f"<= {goal}x: {'met' if met else 'MISSED'}"
    share = gain_share(baseline_s, policy_s, bound_s)
    met = share is not None and share >= SHARE_GOAL
    return f"bound above {goal}x, >= {SHARE_GOAL:.0%} of the gain: {'met' if met else 'MISSED'}"


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def bench_line(argv: list[str]) -> str:
    """One `halfmoon bench router` run with `argv`, as a sentence."""
    figures = bench.run(bench.build_parser().parse_args(argv))
    return (
        f"{figures['decisions_per_s']:,.0f} decisions/s, p50 {figures['p50_us']:.0f} us, "
        f"p99 {figures['p99_us']:.0f} us with {figures['instances']:,} instances and "
        f"{figures['indexed_blocks']:,} indexed blocks ({figures['device']})"
    )


def main(argv: list[str] | None = None) -> int:
    """Run every policy x admission mode on both traces and write the report."""
    parser = argparse.ArgumentParser(
        prog="python -m halfmoon.bench.studies.router_report", description=__doc__
    )
    parser.add_argument("--out", default=str(REPO / "docs" / "router.md"))
    parser.add_argument("--traces", default=str(TRACES), help="folder holding the two traces")
    args = parser.parse_args(argv)
    sections = [line for setup in SETUPS for line in setup_section(setup, Path(args.traces))]
    text = TEMPLATE.read_text().format(
        tables="\n".join(sections),
        scaling="\n".join(scaling_table(Path(args.traces))),
        bench=bench_line([]),
        bench_large=bench_line(LARGE_BENCH),
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


TEMPLATE = Path(__file__).with_name("router_report_template.md")
LARGE_BENCH = ["--instances", "1024", "--blocks", "1000000", "--decisions", "2000"]


if __name__ == "__main__":
    sys.exit(main())
