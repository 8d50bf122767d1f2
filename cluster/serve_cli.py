"""`halfmoon serve`: its flags (each a dotted override of the cluster config, `SERVE_OVERRIDES`)
and the run that loads the config and serves it."""

from __future__ import annotations

import argparse
import os
import re

from halfmoon.cluster.client.cli_options import add_api_key

REDIS_URL_ENV = "HALFMOON_REDIS_URL"  # --redis-url's default: a URL with a password stays out of ps

SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1 << 10, "mi": 1 << 20}
SIZE_UNITS["gi"] = 1 << 30


def parse_bytes(text: str) -> int:
    """`4GiB`, `512MiB`, `2G` or a plain number of bytes, as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4GiB or 512MiB")
    number, unit = match.groups()
    size = int(float(number) * SIZE_UNITS[unit or ""])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return size


def add_serve(commands) -> None:
    cmd = commands.add_parser(
        "serve",
        help="start the cluster: router, prefill and decode pools, KV store, gRPC and OpenAI APIs",
        description="Start halfmoon on Ray (in-process by default, or join a cluster with "
        "--address auto) and serve the gRPC API and the OpenAI-compatible HTTP API until "
        "SIGINT/SIGTERM. Flags override the config file; every default is in "
        "halfmoon.cluster.config (see deploy/configs/).",
    )
    cmd.add_argument("--config", help="YAML config (default: built-in defaults)")
    cmd.add_argument(
        "--model",
        help="checkpoint directory, a GGUF file (or a directory holding one; dequantized once "
        "into $HALFMOON_CACHE/gguf), or a transformers model id already in the local Hugging "
        "Face cache (nothing is downloaded); default: the tiny generated model",
    )
    cmd.add_argument(
        "--served-model-name", help="the model name clients use (default: --model as given)"
    )
    cmd.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and KV dtype (auto: float32 on CPU, the checkpoint's dtype on GPU)",
    )
    cmd.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
        help="KV cache format on every worker, in its pages and on every path KV moves (lent "
        "pages, the store, Redis, across nodes): auto keeps the model's dtype; fp8 (= fp8_e4m3), "
        "fp8_e5m2 and int8 store each token's row of each head in 8 bits with an fp16 scale "
        "(about half the bytes of bf16; blocks of two formats are never shared)",
    )
    cmd.add_argument(
        "--max-model-len",
        type=int,
        help="context length in tokens (default: the model's); prompts must be shorter",
    )
    cmd.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="share of a GPU's memory one worker may use for weights, activations and KV "
        "(default 0.9, scaled by a fractional num_gpus)",
    )
    cmd.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        metavar="SIZE",
        help="KV cache per worker, e.g. 4GiB or 512MiB (default: from free GPU memory; 2 GiB on "
        "CPU)",
    )
    cmd.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="ranks each prefill and decode worker splits the model across, on CPU (a config "
        "sets each pool's: prefill.tensor_parallel_size, decode.tensor_parallel_size)",
    )
    cmd.add_argument(
        "--enforce-eager",
        action="store_const",
        const=True,
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only; for debugging)",
    )
    cmd.add_argument("--prefill", type=int, help="prefill workers")
    cmd.add_argument("--decode", type=int, help="decode workers")
    cmd.add_argument("--mode", choices=["disaggregated", "colocated"])
    cmd.add_argument(
        "--policy",
        help="router policy: conductor (default; predicted TTFT, cache- and load-aware), "
        "cache_aware_local, least_loaded, round_robin, random",
    )
    cmd.add_argument("--host", help="address to bind (default 127.0.0.1)")
    cmd.add_argument("--port", type=int, help="gRPC port (default 50051)")
    cmd.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9400)")
    cmd.add_argument(
        "--http-port",
        type=_http_port,
        metavar="PORT|off",
        help="OpenAI-compatible HTTP API port (default 8000; 0 picks a free one; off: none)",
    )
    add_api_key(
        cmd,
        "require this key from clients: `Authorization: Bearer KEY` on HTTP, the same "
        "`authorization` metadata on gRPC (prefer the environment variable: flags show in ps)",
    )
    cmd.add_argument(
        "--allow-unauthenticated",
        action="store_const",
        const=True,
        help="serve on a --host beyond loopback without an API key (refused otherwise): anyone "
        "who can reach the ports may use the model, read /metrics and cancel requests",
    )
    cmd.add_argument("--address", help="Ray address; `auto` joins a running cluster (ray up)")
    cmd.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV) or None,
        help="Redis tier shared by every node, e.g. redis://:PASSWORD@10.0.0.10:6380/0 "
        f"(default: ${REDIS_URL_ENV}; prefer it when the URL holds a password)",
    )
    cmd.add_argument(
        "--tls-cert", help="PEM certificate chain: serve gRPC and HTTP over TLS (+ --tls-key)"
    )
    cmd.add_argument("--tls-key", help="PEM private key of --tls-cert")
    cmd.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, how long streams in flight may take to finish (default 30)",
    )
    cmd.set_defaults(run=run_serve)


def _http_port(text: str) -> int | str:
    if text == "off":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number or off") from None


SERVE_OVERRIDES = {
    "model": "model",
    "served_model_name": "served_model_name",
    "dtype": "engine.dtype",
    "kv_cache_dtype": "engine.kv_cache_dtype",
    "max_model_len": "engine.max_model_len",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "kv_cache_memory": "engine.kv_cache_memory_bytes",
    "tensor_parallel_size": ("prefill.tensor_parallel_size", "decode.tensor_parallel_size"),
    "enforce_eager": "engine.enforce_eager",
    "prefill": "prefill.replicas",
    "decode": "decode.replicas",
    "mode": "mode",
    "policy": "router.policy",
    "host": "server.host",
    "port": "server.grpc_port",
    "metrics_port": "server.metrics_port",
    "http_port": "server.http_port",
    "api_key": "server.api_key",
    "allow_unauthenticated": "server.allow_unauthenticated",
    "address": "ray.address",
    "redis_url": "store.redis_url",
    "tls_cert": "server.tls_cert",
    "tls_key": "server.tls_key",
    "drain_timeout": "server.drain_timeout_s",
}


def run_serve(args) -> int:
    from halfmoon.cluster.config import load_config
    from halfmoon.cluster.serve import serve

    overrides = {
        key: getattr(args, flag)
        for flag, keys in SERVE_OVERRIDES.items()
        for key in ((keys,) if isinstance(keys, str) else keys)
        if getattr(args, flag) is not None
    }
    return serve(load_config(args.config, overrides))
