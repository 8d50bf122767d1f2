"""What deploy/gpu/serve-bench.sh measured, read from its folder of `bench serve` results.

    serve_report.py next OUT MODE TARGET    the next rate to try in MODE's search for the
                                            largest rate meeting the SLOs (nothing: done)
    serve_report.py summary OUT TARGET DEVICE USE_REDIS SLO...
                                            one line per run, the two modes side by side, and
                                            the largest rate each met

A run meets the SLOs when at least TARGET of its requests did (`bench serve --goodput`'s
slo_attainment; failed requests miss); a run with no result (killed at its limit) missed.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

MODES = ("disaggregated", "colocated")
RUN_NAME = re.compile(r"serve-(?P<mode>[a-z]+)-(?P<rate>[0-9.]+)rps\.json")
CLOSE_ENOUGH = 1.5  # the search stops once the missed rate is within this factor of the met one
SHARED_GPU = (
    "one GPU shared by every worker: in the disaggregated run the prefill and the decode "
    "process time-slice it, so its figures measure the KV transfer path and the engine, not "
    "prefill/decode pool isolation"
)
SHARED_CPU = "on CPU (a rehearsal): every worker shares the machine's cores"


def load_runs(out: Path, mode: str) -> dict[float, dict | None]:
    """MODE's `bench serve` results by rate (None: the run left no JSON)."""
    runs = {}
    for path in out.glob(f"serve-{mode}-*rps.json"):
        if (name := RUN_NAME.fullmatch(path.name)) and name["mode"] == mode:
            runs[float(name["rate"])] = _json(path)
    return dict(sorted(runs.items()))


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def met(run: dict | None, target: float) -> bool:
    return run is not None and (run.get("slo_attainment") or 0.0) >= target


def bounds(runs: dict[float, dict | None], target: float) -> tuple[float | None, float | None]:
    """The largest rate that met the SLOs and the smallest rate above it that missed."""
    good = [rate for rate, run in runs.items() if met(run, target)]
    best = max(good, default=None)
    missed = [rate for rate, run in runs.items() if not met(run, target)]
    above = [rate for rate in missed if best is None or rate > best]
    return best, min(above, default=None)


def next_rate(runs: dict[float, dict | None], target: float) -> float | None:
    """Halfway (geometric) between the bounds, past an open end by a factor of 2; None once
    the bounds are within CLOSE_ENOUGH of each other or nothing has run."""
    best, worst = bounds(runs, target)
    if best is None and worst is None:
        return None
    if worst is None:
        return best * 2
    if best is None:
        return worst / 2
    if worst / best <= CLOSE_ENOUGH:
        return None
    return round(math.sqrt(best * worst), 1)


def rate_text(rate: float) -> str:
    return f"{rate:g}"


def run_line(mode: str, rate: float, run: dict | None, target: float) -> str:
    head = f"{mode:>13} {rate_text(rate):>4} req/s"
    if run is None:
        return f"{head}: no result (killed at its limit, or it failed: see its .log)"
    verdict = "meets" if met(run, target) else "misses"
    return (
        f"{head}: TTFT p50 {run['median_ttft_ms']:.0f} / p99 {run['p99_ttft_ms']:.0f} ms, "
        f"TPOT p50 {run['median_tpot_ms']:.1f} / p99 {run['p99_tpot_ms']:.1f} ms, goodput "
        f"{run['request_goodput'] or 0:.2f} req/s ({run['slo_attainment'] or 0:.0%} within the "
        f"SLOs: {verdict}), {run['output_throughput']:.0f} output tok/s, {run['failed']} failed"
    )


def largest_line(mode: str, runs: dict[float, dict | None], target: float) -> str:
    best, worst = bounds(runs, target)
    if not runs:
        return f"{mode:>13}: nothing ran"
    if best is None:
        return f"{mode:>13}: met the SLOs at none of the rates run (lowest {rate_text(worst)})"
    beyond = f"missed at {rate_text(worst)}" if worst else "or more: the highest rate run"
    return f"{mode:>13}: largest rate meeting the SLOs {rate_text(best)} req/s ({beyond})"


def summary(out: Path, target: float, device: str, use_redis: str, slo: list[str]) -> list[str]:
    runs = {mode: load_runs(out, mode) for mode in MODES}
    lines = [SHARED_CPU if device == "cpu" else SHARED_GPU]
    if use_redis != "true":
        lines.append("served without the Redis tier: redis-server did not start")
    lines.append(f"SLOs: {' '.join(slo)} (ms) for at least {target:.0%} of requests")
    lines += [run_line(m, r, run, target) for m in MODES for r, run in runs[m].items()]
    lines += [largest_line(m, runs[m], target) for m in MODES]
    checked = [mode for mode in MODES if (out / f"live-capacity-{mode}.json").exists()]
    lines += [live_line(out, mode) for mode in checked]
    return lines


def live_line(out: Path, mode: str) -> str:
    result = _json(out / f"live-capacity-{mode}.json")
    if result is None:
        return f"{mode:>13} live capacity: no result"
    rows = ", ".join(
        f"{x['rate_rps']:.2f} req/s live {x['live_attainment']:.2f} sim "
        f"{x['simulated_attainment']:.2f}"
        for x in result["rates"]
    )
    agree = result["all_agree"]
    return f"{mode:>13} live vs simulated attainment (agree within 0.1: {agree}): {rows}"


def main(argv: list[str]) -> int:
    command, out = argv[0], Path(argv[1])
    if command == "next":
        rate = next_rate(load_runs(out, argv[2]), float(argv[3]))
        print("" if rate is None else rate_text(rate))
        return 0
    print("\n".join(summary(out, float(argv[2]), argv[3], argv[4], argv[5:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
