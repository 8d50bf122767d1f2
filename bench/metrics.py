"""What `bench serve` measures per request, and the summary it reports, named as `vllm bench
serve` names them (mean_ttft_ms, p99_itl_ms, request_goodput, ...)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from halfmoon.router.sim.summary import percentile

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_TITLES = {  # in report order
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds, `sent_s` from the run's start."""

    sent_s: float
    num_prompt_tokens: int
    error: str = ""  # a code: a gRPC status name, HTTP_<status>, TIMEOUT, CONNECTION_ERROR, ...
    error_message: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    num_output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for a single-token output."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.num_output_tokens - 1)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` (milliseconds) as {"ttft": 500.0, ...}."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {GOODPUT_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: write METRIC:MS, e.g. ttft:500") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99` as [50.0, 90.0, 99.0]; each in (0, 100]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: write numbers, e.g. 50,90,99") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in (0, 100]")
    return values


def percentile_key(p: float, name: str) -> str:
    """`p99_ttft_ms`, `p99.9_itl_ms`: vllm's names for a percentile."""
    word = str(int(p)) if p == int(p) else str(p)
    return f"p{word}_{name}_ms"


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a served request meets every given SLO."""
    seconds = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    return all(seconds[name] * 1000 <= limit for name, limit in slos_ms.items())


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Each latency's samples in seconds over the served requests: one TPOT per request with
    at least two output tokens, one ITL per gap between streamed chunks."""
    served = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft_s for r in served],
        "tpot": [r.tpot_s for r in served if r.num_output_tokens > 1],
        "itl": [gap for r in served for gap in r.itl_s],
        "e2el": [r.e2el_s for r in served],
    }


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: list[float] = (50.0, 90.0, 99.0),
    goodput_ms: dict[str, float] | None = None,
) -> dict:
    """The run's figures: counts, throughputs per second of `duration_s`, and for each latency
    its mean, median, std and percentiles in milliseconds; errors counted by code."""
    served = [r for r in results if r.ok]
    total_input = sum(r.num_prompt_tokens for r in served)
    total_output = sum(r.num_output_tokens for r in served)
    figures: dict = {
        "duration": duration_s,
        "completed": len(served),
        "failed": len(results) - len(served),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(served) / duration_s,
        "request_goodput": None,
        "slo_attainment": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if goodput_ms:
        good = sum(1 for r in served if is_good(r, goodput_ms))
        figures["request_goodput"] = good / duration_s
        figures["slo_attainment"] = good / len(results) if results else 0.0
    for name, samples in latency_samples(results).items():
        figures.update(latency_figures(name, samples, percentiles))
    errors = Counter(r.error for r in results if not r.ok)
    figures["errors"] = dict(sorted(errors.items()))
    messages = {r.error: r.error_message for r in reversed(results) if not r.ok}
    figures["error_messages"] = dict(sorted(messages.items()))
    return figures


def latency_figures(name: str, samples_s: list[float], percentiles: list[float]) -> dict:
    """mean_/median_/std_/pNN_ `name` _ms over samples in seconds (0 when there are none)."""
    ordered = sorted(s * 1000 for s in samples_s)
    figures = {
        f"mean_{name}_ms": statistics.fmean(ordered) if ordered else 0.0,
        f"median_{name}_ms": statistics.median(ordered) if ordered else 0.0,
        f"std_{name}_ms": statistics.pstdev(ordered) if ordered else 0.0,
    }
    for p in percentiles:
        figures[percentile_key(p, name)] = percentile(ordered, p / 100)
    return figures


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """B / A for every number both summaries hold; None where A is 0."""
    out: dict[str, float | None] = {}
    for key, value in a.items():
        other = b.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(other, int | float):
            out[key] = other / value if value else None
    return out


def format_summary(title: str, figures: dict, percentiles: list[float]) -> str:
    """The summary as `vllm bench serve` prints it: a labelled block per latency."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<48} {text}")

    row("Successful requests:", figures["completed"])
    row("Failed requests:", figures["failed"])
    row("Benchmark duration (s):", figures["duration"])
    row("Total input tokens:", figures["total_input_tokens"])
    row("Total generated tokens:", figures["total_output_tokens"])
    row("Request throughput (req/s):", figures["request_throughput"])
    if figures["request_goodput"] is not None:
        row("Request goodput (req/s):", figures["request_goodput"])
        row("SLO attainment (share of all requests):", figures["slo_attainment"])
    row("Output token throughput (tok/s):", figures["output_throughput"])
    row("Total token throughput (tok/s):", figures["total_token_throughput"])
    for name, heading in LATENCY_TITLES.items():
        upper = name.upper()
        lines.append(f"{heading:-^60}")
        row(f"Mean {upper} (ms):", figures[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", figures[f"median_{name}_ms"])
        for p in (p for p in percentiles if p != 50):  # p50 is the median, printed above
            label = percentile_key(p, name).split("_")[0].upper()
            row(f"{label} {upper} (ms):", figures[percentile_key(p, name)])
    for code, count in figures["errors"].items():
        row(f"Errors {code}:", f"{count}  ({figures['error_messages'][code][:60]})")
    lines.append("=" * 60)
    return "\n".join(lines)
