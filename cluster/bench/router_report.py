"""`python -m halfmoon.cluster.bench.router_report`: regenerate docs/router.md from
simulations and the router bench."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from halfmoon.cluster.bench import router as bench
from halfmoon.router.config import ADMISSION_MODES, POLICY_NAMES, RouterConfig
from halfmoon.router.profile import DEFAULT_PROFILE, load_profile
from halfmoon.router.sim.simulation import Simulation
from halfmoon.router.sim.summary import SimSummary
from halfmoon.router.sim.trace import read_trace

REPO = Path(__file__).resolve().parent.parent
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
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.04

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
    cache_blocks = profile.cache_blocks(512)
    simulation = Simulation(config, profile, setup.prefill, setup.decode, cache_blocks)
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


def main(argv: list[str] | None = None) -> int:
    """Run every policy x admission mode on both traces and write the report."""
    parser = argparse.ArgumentParser(
        prog="python -m halfmoon.cluster.bench.router_report", description=__doc__
    )
    parser.add_argument("--out", default=str(REPO / "docs" / "router.md"))
    parser.add_argument("--traces", default=str(TRACES), help="folder holding the two traces")
    args = parser.parse_args(argv)
    sections: list[str] = []
    for setup in SETUPS:
        results = {}
        for policy in POLICY_NAMES:
            for admission in ADMISSION_MODES:
                results[(policy, admission)] = simulate(setup, policy, admission, Path(args.traces))
                print(f"{setup.trace} {policy} {admission} done", file=sys.stderr)
        sections += [
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
    figures = bench.run(bench.build_parser().parse_args([]))
    text = TEMPLATE.read_text().format(
        tables="\n".join(sections),
        bench=(
            f"{figures['decisions_per_s']:,.0f} decisions/s, p50 {figures['p50_us']:.0f} us, "
            f"p99 {figures['p99_us']:.0f} us with {figures['instances']} instances and "
            f"{figures['indexed_blocks']:,} indexed blocks ({figures['device']})"
        ),
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


TEMPLATE = Path(__file__).with_name("router_report_template.md")


if __name__ == "__main__":
    sys.exit(main())
