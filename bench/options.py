"""Command-line options several `halfmoon bench` targets share, each declared once."""

from __future__ import annotations

import argparse
import os

from halfmoon.bench.workload import TRACE_BLOCK_TOKENS
from halfmoon.cluster.client.grpc_client import DEFAULT_ADDRESS
from halfmoon.cluster.frontend.auth import API_KEY_ENV


def bench_parser(
    target: str, description: str | None, *, json: bool = True, progress: bool = False, **kwargs
) -> argparse.ArgumentParser:
    """The parser of `halfmoon bench TARGET`: with --json (one JSON object instead of the
    table) and, with `progress`, --disable-tqdm."""
    parser = argparse.ArgumentParser(
        prog=f"halfmoon bench {target}", description=description, **kwargs
    )
    if json:
        parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    if progress:
        parser.add_argument(
            "--disable-tqdm", action="store_true", help="no progress bars on stderr"
        )
    return parser


def add_server_options(group, request_timeout_help: str) -> None:
    """Which gRPC server to load, with which key, and how long one request may take."""
    group.add_argument(
        "--server", default=DEFAULT_ADDRESS, help="gRPC server HOST:PORT (%(default)s)"
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY"),
        help=f"the server's API key, sent as a Bearer token on HTTP and gRPC (default: "
        f"${API_KEY_ENV}, else $OPENAI_API_KEY)",
    )
    group.add_argument("--request-timeout", type=float, default=600.0, help=request_timeout_help)


def add_workload_options(group, num_prompts: int, num_prompts_help: str, seed_help: str) -> None:
    """The workload: how many requests, their lengths (a trace's, or random ones) and the seed
    of their prompts (`bench serve`, `bench live-capacity`)."""
    group.add_argument("--num-prompts", type=int, default=num_prompts, help=num_prompts_help)
    group.add_argument("--seed", type=int, default=0, help=seed_help)
    group.add_argument(
        "--trace",
        help="Mooncake-format JSONL trace (e.g. ../shared/traces/conversation_trace.jsonl): its "
        "first --num-prompts requests, each hash id a fixed block of token ids so shared "
        "prefixes stay shared; without it, random lengths",
    )
    group.add_argument(
        "--block-tokens",
        type=int,
        default=TRACE_BLOCK_TOKENS,
        help="tokens per trace hash id (%(default)s, the traces' own); fewer scales input and "
        "output lengths down alike (e.g. 16 for the tiny CPU model)",
    )
    group.add_argument(
        "--random-input-len", type=int, default=1024, help="mean prompt tokens (%(default)s)"
    )
    group.add_argument(
        "--random-output-len", type=int, default=128, help="mean output tokens (%(default)s)"
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (%(default)s)",
    )
    group.add_argument(
        "--random-output-range-ratio",
        type=float,
        help="the same for output lengths alone, e.g. 0 for fixed outputs under varied prompts "
        "(default: --random-range-ratio)",
    )


def add_slo_options(parser, ttft_help: str, tbt_help: str) -> None:
    """--ttft-slo and --tbt-slo, in seconds."""
    parser.add_argument("--ttft-slo", type=float, help=ttft_help)
    parser.add_argument("--tbt-slo", type=float, help=tbt_help)


def add_pool_options(parser: argparse.ArgumentParser, prefill: int, decode: int) -> None:
    """`--prefill` and `--decode`: the workers of each pool of the cluster a benchmark starts."""
    parser.add_argument(
        "--prefill", type=int, default=prefill, help="prefill workers (%(default)s)"
    )
    parser.add_argument("--decode", type=int, default=decode, help="decode workers (%(default)s)")
