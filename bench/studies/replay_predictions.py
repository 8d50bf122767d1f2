"""What `halfmoon bench replay` compares per request: the router's predicted TTFT against the
measured (live) or simulated one, its cache use, and the summary of the errors."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, make_dataclass

from halfmoon.router.decision import Decision
from halfmoon.router.sim.simulation import Simulation
from halfmoon.router.sim.summary import SimSummary, percentile
from halfmoon.router.sim.trace import TraceRecord

# The simulator's headline figures, for a live or a simulated run: these fields of SimSummary.
FIGURE_FIELDS = (
    "requests",
    "rejected",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tbt_mean_s",
    "tbt_p99_s",
    "slo_attainment",
    "hit_rate",
    "throughput_rps",
)
Figures = make_dataclass(
    "Figures",
    [(f.name, f.type) for f in fields(SimSummary) if f.name in FIGURE_FIELDS],
    slots=True,
    namespace={"__module__": __name__},  # make_dataclass would name `types` (Python 3.11)
)


def figures_of(summary: SimSummary) -> Figures:
    """A simulated run's figures, taken from its summary."""
    return Figures(**{name: getattr(summary, name) for name in FIGURE_FIELDS})


@dataclass(slots=True)
class RequestView:
    """One request as one side saw it: the TTFT its router predicted against the one measured
    at the live router (or simulated), and the prefix it found cached or fetched."""

    predicted_ttft_s: float | None
    predicted_queue_s: float | None  # of it, waiting for the prefill instance (None: not known)
    ttft_s: float | None  # None: not served
    num_cached_tokens: int
    num_fetched_tokens: int  # of the cached ones, brought from elsewhere (live: the store)
    fetched_from: str | None
    prefill_instance: str | None
    decode_instance: str | None
    outcome: str


@dataclass(slots=True)
class PredictionFigures:
    """One side's relative TTFT prediction error, |predicted - measured| / measured, and its
    cache use, over the requests every side reports."""

    requests: int
    predicted: int  # of those, with both a prediction and a TTFT
    error_p50: float
    error_p90: float
    bias_p50: float  # median of (predicted - measured) / measured: below 0 predicts too short
    queued: int | None  # predicted to wait for their prefill instance (None: not known)
    bypassed: int  # served with no prefill instance: prefilled on their decode instance
    cached_tokens: int
    fetches: int
    fetched_tokens: int


@dataclass(slots=True)
class Side:
    """A live or simulated run: its headline figures and each request as it saw it (in trace
    order; None where that side kept no record of it)."""

    figures: Figures
    views: list[RequestView | None]


def request_ids(count: int) -> list[str]:
    """The ids the replay sends its requests under, so the router's summaries match them."""
    return [f"replay-{i}" for i in range(count)]


def relative_errors(views: Iterable[RequestView]) -> list[float]:
    """Sorted (predicted - measured) / measured TTFT of the views that have both."""
    return sorted(
        (view.predicted_ttft_s - view.ttft_s) / view.ttft_s
        for view in views
        if view.predicted_ttft_s is not None and view.ttft_s
    )


def quantile(sorted_values: list[float], q: float) -> float:
    """The `q` quantile of sorted values; NaN when there are none."""
    return percentile(sorted_values, q) if sorted_values else math.nan


def prediction_figures(views: list[RequestView]) -> PredictionFigures:
    """The prediction error quantiles and the cache use of one side's views."""
    signed = relative_errors(views)
    errors = sorted(abs(error) for error in signed)
    fetched = [view.num_fetched_tokens for view in views if view.num_fetched_tokens > 0]
    bypassed = sum(view.prefill_instance is None and view.ttft_s is not None for view in views)
    return PredictionFigures(
        len(views),
        len(errors),
        quantile(errors, 0.5),
        quantile(errors, 0.9),
        quantile(signed, 0.5),
        num_queued(views),
        bypassed,
        sum(view.num_cached_tokens for view in views),
        len(fetched),
        sum(fetched),
    )


def num_queued(views: list[RequestView]) -> int | None:
    """How many views were predicted to queue for their prefill; None when none knows."""
    queues = [view.predicted_queue_s for view in views if view.predicted_queue_s is not None]
    return sum(queue_s > 0 for queue_s in queues) if queues else None


def common_views(sides: dict[str, list[RequestView | None]]) -> dict[str, list[RequestView]]:
    """Each side's views of the requests that every side has a view of."""
    rows = [row for row in zip(*sides.values(), strict=True) if None not in row]
    return {name: [row[i] for row in rows] for i, name in enumerate(sides)}


def prediction_summary(sides: dict[str, list[RequestView | None]]) -> dict:
    """`PredictionFigures` per side over the requests all report, and the live cache-hit
    tokens over the simulated ones."""
    figures = {name: prediction_figures(views) for name, views in common_views(sides).items()}
    live, simulated = figures["live"].cached_tokens, figures["simulated"].cached_tokens
    ratio = live / simulated if simulated else math.nan
    return {**{name: asdict(f) for name, f in figures.items()}, "cached_live_over_sim": ratio}


def live_view(summary: dict) -> RequestView:
    """A request as the live router summarised it (`RouterActor.summaries`)."""
    return RequestView(
        summary["predicted_ttft_s"],
        summary.get("predicted_queue_s"),
        summary["ttft_s"],
        summary["num_cached_tokens"],
        summary["num_loaded_tokens"],
        summary["loaded_from"],
        summary["prefill_instance"],
        summary["decode_instance"],
        summary["outcome"],
    )


def live_views(summaries: list[dict], ids: list[str]) -> list[RequestView | None]:
    """The router's summaries in the order of `ids`; None for a request it no longer keeps."""
    by_id = {summary["request_id"]: live_view(summary) for summary in summaries}
    return [by_id.get(request_id) for request_id in ids]


def simulated_view(decision: Decision, ttft_s: float) -> RequestView:
    """A request as the simulated Conductor placed it (a bypassed prompt starts cold on its
    decode instance) and the TTFT it got there (inf: rejected)."""
    fetch = None if decision.bypass else decision.fetch_from
    return RequestView(
        None if decision.rejected else decision.predicted_ttft_s,
        None if decision.rejected else decision.predicted_queue_s,
        ttft_s if math.isfinite(ttft_s) else None,
        0 if decision.bypass else decision.cached_tokens,
        decision.fetch_tokens if fetch else 0,
        None if fetch is None else str(fetch[0]),
        None if decision.bypass else decision.prefill_instance,
        decision.decode_instance,
        "rejected" if decision.rejected else "finished",
    )


def simulated_views(sim: Simulation) -> list[RequestView | None]:
    """Every request of a finished simulation in trace order (None once the Conductor has
    forgotten its decision: `RouterConfig.explain_capacity`)."""
    ttfts, _ = sim.latencies()
    view = sim.conductor.view()
    decisions = [view.decision(str(i)) for i in range(len(ttfts))]  # the sim's ids
    return [
        None if decision is None else simulated_view(decision, float(ttft_s))
        for decision, ttft_s in zip(decisions, ttfts, strict=True)
    ]


def request_rows(
    records: list[TraceRecord], sides: dict[str, list[RequestView | None]]
) -> list[dict]:
    """One plain row per request: its id, lengths and arrival, and each side's view."""
    rows = []
    for i, (request_id, record) in enumerate(zip(request_ids(len(records)), records, strict=True)):
        row = {
            "request_id": request_id,
            "arrival_s": record.arrival_s,
            "num_prompt_tokens": record.num_prompt_tokens,
            "num_output_tokens": record.num_output_tokens,
        }
        for name, views in sides.items():
            row[name] = None if views[i] is None else asdict(views[i])
        rows.append(row)
    return rows
