"""`halfmoon bench serve`: a client-side load generator against a running server (halfmoon's
gRPC API or an OpenAI-compatible HTTP API), reporting what `vllm bench serve` reports."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

from halfmoon.bench.metrics import (
    RequestResult,
    format_summary,
    parse_goodput,
    parse_percentiles,
    ratios,
    summarize,
)
from halfmoon.bench.options import add_server_options, add_workload_options, bench_parser
from halfmoon.bench.targets import BACKENDS, TargetUnreachableError, make_target
from halfmoon.bench.workload import (
    ARRIVALS,
    BenchRequest,
    WorkloadError,
    arrival_times,
    prompt_vocabulary,
    random_requests,
    rescale_to_rate,
    trace_requests,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
RATIO_KEYS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "slo_attainment",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(
        "serve",
        progress=True,
        description="Send a workload to a running server and report TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, std, percentiles, in ms), request and token "
        "throughput, goodput under SLOs and errors by code, named as `vllm bench serve` names "
        "them. Every request streams, with ignore_eos so it generates exactly its output "
        "length, and greedy sampling.",
        epilog="Output (--json keys; with --compare under runs[0], runs[1] and "
        "ratio_b_over_a): completed, failed, duration (s), total_input_tokens, "
        "total_output_tokens, request_throughput (req/s), request_goodput (req/s) and "
        "slo_attainment (share of all requests meeting the SLOs; both null without --goodput), "
        "output_throughput and total_token_throughput (tok/s); for each of ttft, tpot, itl, "
        "e2el: mean_X_ms, median_X_ms, std_X_ms and pNN_X_ms; errors (count by code: a gRPC "
        "status, HTTP_<status>, TIMEOUT, CONNECTION_ERROR, ...) and error_messages; server "
        "(its model, and over gRPC its mode and version); config (the load sent). TPOT is "
        "(e2el - ttft) / (output tokens - 1) per request; ITL is every gap between streamed "
        "chunks. Exit status 2 when a server cannot be reached.",
    )
    where = parser.add_argument_group("server")
    add_server_options(where, "seconds per request (HTTP: per read) (%(default)s)")
    where.add_argument(
        "--backend",
        choices=BACKENDS,
        default="grpc",
        help="grpc (default): halfmoon's Generate stream (prompts as token ids); openai: POST "
        "/v1/completions with stream=true; openai-chat: POST /v1/chat/completions (text)",
    )
    where.add_argument(
        "--base-url", default=DEFAULT_BASE_URL, help="HTTP server for openai* (%(default)s)"
    )
    where.add_argument(
        "--endpoint",
        help="HTTP path (default: /v1/completions, or /v1/chat/completions for openai-chat)",
    )
    where.add_argument(
        "--model", help="the model field of HTTP requests (default: the first of /v1/models)"
    )
    where.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="run the same requests against A, then B ([grpc://]HOST:PORT or http://...), and "
        "print both and the ratios B/A; replaces --server / --base-url",
    )
    where.add_argument(
        "--across-nodes",
        action="store_true",
        help="instead: start halfmoon on Ray nodes of this machine with prefill and decode on "
        "two nodes (KV on Mooncake's Transfer Engine), then on one, and compare (issue 48; its "
        "options: `halfmoon bench serve --across-nodes --help`)",
    )
    work = parser.add_argument_group("workload")
    add_workload_options(
        work,
        100,
        "requests to send (%(default)s)",
        "seed of random prompts and arrivals (%(default)s)",
    )
    work.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="trace arrivals speed-up: send time = trace time / X (%(default)s)",
    )
    work.add_argument(
        "--tokenizer",
        help="tokenizer (directory, GGUF file or cached transformers id) whose ids prompts use "
        "and that decodes text prompts (default: the tiny default model's byte tokenizer)",
    )
    work.add_argument(
        "--prompt-format",
        choices=("token_ids", "text"),
        default="token_ids",
        help="how /v1/completions prompts go (%(default)s); gRPC always sends ids, chat "
        "always text",
    )
    load = parser.add_argument_group("arrivals")
    load.add_argument(
        "--arrival",
        choices=ARRIVALS,
        help="poisson (gamma gaps with --burstiness), constant (evenly spaced) or trace "
        "(the trace's timestamps; with --request-rate stretched to that mean rate) "
        "(default: trace with --trace, else poisson)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        help="requests per second; inf sends all at once (default: inf, or the trace's own timing)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of poisson gaps (%(default)s): 1 is Poisson, below 1 burstier, above 1 "
        "steadier",
    )
    load.add_argument(
        "--max-concurrency", type=int, help="most requests in flight at once (default: no cap)"
    )
    load.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="send the first N requests one by one before the run, unmeasured (%(default)s); "
        "they also warm the server's prefix cache",
    )
    out = parser.add_argument_group("report")
    out.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        default=[],
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:3000: request_goodput is the served "
        "requests meeting all of them per second, slo_attainment their share of all requests",
    )
    out.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="percentiles reported per latency (%(default)s)",
    )
    out.add_argument(
        "--plot", metavar="FILE.png", help="write latency CDFs and TTFT over time to a PNG"
    )
    return parser


def load_vocabulary(name: str | None) -> tuple[object, list[int]]:
    """The tokenizer and the ids prompts are drawn from."""
    if name is None:
        from halfmoon.engine.init_model import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        from transformers import AutoTokenizer

        from halfmoon.engine.errors import ModelLoadError
        from halfmoon.engine.gguf_source import converted_checkpoint, gguf_file

        try:
            gguf = gguf_file(Path(name))
            tokenizer = AutoTokenizer.from_pretrained(converted_checkpoint(gguf) if gguf else name)
        except (OSError, ValueError, ModelLoadError) as error:
            raise WorkloadError(f"cannot load --tokenizer {name!r}: {error}") from None
    return tokenizer, prompt_vocabulary(tokenizer)


def build_requests(args, vocabulary: list[int]) -> list[BenchRequest]:
    """The workload, with each request's send time set."""
    if args.num_prompts < 1:
        raise WorkloadError(f"--num-prompts {args.num_prompts} must be >= 1")
    arrival = args.arrival or ("trace" if args.trace else "poisson")
    if args.trace:
        requests = trace_requests(
            args.trace, args.num_prompts, args.block_tokens, args.time_scale, vocabulary
        )
    else:
        if arrival == "trace":
            raise WorkloadError("--arrival trace needs --trace FILE")
        requests = random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocabulary,
            args.seed,
            args.random_output_range_ratio,
        )
    if arrival == "trace":
        if args.request_rate is not None:
            rescale_to_rate(requests, args.request_rate)
        return requests
    rate = math.inf if args.request_rate is None else args.request_rate
    times = arrival_times(len(requests), arrival, rate, args.burstiness, args.seed)
    for request, at in zip(requests, times, strict=True):
        request.arrival_s = at
    return requests


async def run_load(
    target, requests: list[BenchRequest], max_concurrency: int | None, progress: tqdm
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival time (at most `max_concurrency` in flight)."""
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    started = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - started)))
        async with limit:
            result = await target.send(request, started)
        progress.update(1)
        return result

    results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), time.perf_counter() - started


async def bench_target(target, requests, vocabulary, args) -> tuple[list[RequestResult], float]:
    """Check the target, then run the load against it; the connection is closed after."""
    try:
        await target.open(max(vocabulary))
        for request in requests[: args.num_warmups]:
            await target.send(request, time.perf_counter())
        with tqdm(total=len(requests), desc=target.label, disable=args.disable_tqdm) as bar:
            return await run_load(target, requests, args.max_concurrency, bar)
    finally:
        await target.close()


def run(args) -> dict:
    """The target's figures, or with --compare both targets' and the ratios B/A, as `--json`
    prints them."""
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    tokenizer, vocabulary = load_vocabulary(args.tokenizer)
    requests = build_requests(args, vocabulary)
    specs = args.compare or [args.server if args.backend == "grpc" else args.base_url]
    runs = []
    for spec in specs:
        target = make_target(spec, args, tokenizer)
        results, duration_s = asyncio.run(bench_target(target, requests, vocabulary, args))
        figures = summarize(results, duration_s, percentiles, goodput)
        runs.append((target.label, results, {"server": target.server, **figures}))
    if args.plot:
        from halfmoon.bench.plot import plot_runs

        plot_runs([(title(label, f), results) for label, results, f in runs], args.plot)
    config = run_config(args, requests)
    if len(runs) == 1:
        label, _, figures = runs[0]
        return {"target": label, "config": config, **figures}
    return {
        "config": config,
        "runs": [{"target": label, **figures} for label, _, figures in runs],
        "ratio_b_over_a": ratios(runs[0][2], runs[1][2]),
    }


def run_config(args, requests: list[BenchRequest]) -> dict:
    """The load that was sent, to print next to the figures."""
    return {
        "backend": args.backend,
        "num_prompts": len(requests),
        "workload": args.trace or "random",
        "block_tokens": args.block_tokens if args.trace else None,
        "time_scale": args.time_scale if args.trace else None,
        "arrival": args.arrival or ("trace" if args.trace else "poisson"),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput": args.goodput,
        "num_warmups": args.num_warmups,
        "mean_input_tokens": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "mean_output_tokens": sum(r.max_tokens for r in requests) / len(requests),
        "last_arrival_s": max(r.arrival_s for r in requests),
    }


def title(label: str, figures: dict) -> str:
    """A target's address, with the server's mode when it reports one."""
    mode = figures["server"].get("mode")
    return f"{label} ({mode})" if mode else label


def print_report(report: dict, percentiles: list[float]) -> None:
    print("load: " + json.dumps(report["config"]))
    for run_ in report.get("runs", [report]):
        print(format_summary(title(run_["target"], run_), percentiles=percentiles, figures=run_))
    if "ratio_b_over_a" in report:
        a, b = (r["target"] for r in report["runs"])
        print(f"{' B / A  (A ' + a + ', B ' + b + ') ':=^60}")
        for key in RATIO_KEYS:
            value = report["ratio_b_over_a"].get(key)
            print(f"{key:<48} {'n/a' if value is None else f'{value:.3f}'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--across-nodes" in argv:
        from halfmoon.bench import serve_nodes

        return serve_nodes.main([arg for arg in argv if arg != "--across-nodes"])
    args = build_parser().parse_args(argv)

    def show(report: dict) -> None:
        print_report(report, parse_percentiles(args.metric_percentiles))

    return report_main("halfmoon bench serve", run, show, args)


def report_main(command: str, measure, show, args: argparse.Namespace) -> int:
    """`measure(args)` printed as JSON (--json) or by `show`; exit status 2 when a server cannot
    be reached or the load is wrong."""
    try:
        report = measure(args)
    except (TargetUnreachableError, WorkloadError, ValueError, OSError) as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        show(report)
    return 0
