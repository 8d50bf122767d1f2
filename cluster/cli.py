"""The `halfmoon` command line: serve, generate, status, init-model, bench, simulate."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from halfmoon.cluster.client.cli_options import add_api_key, add_tls_ca
from halfmoon.cluster.serve_cli import add_serve
from halfmoon.cluster.version import package_version

# `halfmoon bench TARGET`, grouped as `--help` shows them: what a user measures a deployment
# with, the probes of one part each, the router's studies (simulator and traces), chaos.
BENCHMARK_GROUPS = {
    "serving": {
        "serve": "halfmoon.bench.serve",
        "engine": "halfmoon.bench.engine",
    },
    "probes": {
        "agreement": "halfmoon.bench.probes.agreement",
        "step": "halfmoon.bench.probes.step",
        "kernels": "halfmoon.bench.probes.kernels",
        "cpu-linear": "halfmoon.bench.probes.cpu_linear",
        "kvstore": "halfmoon.bench.probes.kvstore",
        "rdt": "halfmoon.bench.probes.rdt",
        "transfer": "halfmoon.bench.probes.transfer",
        "prefix-load": "halfmoon.bench.probes.prefix_load",
        "ttft": "halfmoon.bench.probes.ttft",
        "structured": "halfmoon.bench.probes.structured",
        "hostile-grammars": "halfmoon.bench.probes.grammar_flood",
        "path-trace": "halfmoon.bench.probes.path_trace",
    },
    "router studies": {
        "router": "halfmoon.bench.studies.router",
        "replay": "halfmoon.bench.studies.replay",
        "capacity": "halfmoon.bench.studies.capacity",
        "live-capacity": "halfmoon.bench.studies.live_capacity",
    },
    "chaos": {"chaos": "halfmoon.bench.chaos.run"},
}
BENCHMARKS = {name: module for group in BENCHMARK_GROUPS.values() for name, module in group.items()}
# Commands whose own parser lives in their module; everything after the name is theirs.
FORWARDED = {
    "simulate": "halfmoon.router.sim.simulate",
    "profile": "halfmoon.cluster.control.measured_profile",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="halfmoon",
        description="halfmoon: a Mooncake-style disaggregated LLM serving cluster.",
    )
    parser.add_argument("--version", action="version", version=f"halfmoon {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve(commands)
    _add_generate(commands)
    _add_status(commands)
    _add_init_model(commands)
    bench = commands.add_parser(
        "bench",
        help="run a benchmark: "
        + "; ".join(f"{group}: {', '.join(names)}" for group, names in BENCHMARK_GROUPS.items()),
        description="Benchmarks; `halfmoon bench TARGET --help` lists a target's options.",
    )
    bench.add_argument("target", choices=sorted(BENCHMARKS))
    commands.add_parser("simulate", help="simulate the router on a trace (`simulate --help`)")
    commands.add_parser("profile", help="measure this machine's router profile (`profile --help`)")
    return parser


def _add_status(commands) -> None:
    cmd = commands.add_parser(
        "status", help="show workers, their load and the KV store of a running server"
    )
    cmd.add_argument("--server", default="127.0.0.1:50051", help="server host:port")
    add_tls_ca(cmd)
    cmd.add_argument("--json", action="store_true", help="print the raw JSON")
    cmd.add_argument(
        "--explain",
        metavar="REQUEST_ID",
        help="show the router's candidates, predictions and choice for a request (its id "
        "from `generate`, or the X-Request-Id header of an HTTP response)",
    )
    add_api_key(cmd, "the server's API key")
    cmd.set_defaults(run=_run_status)


def _run_status(args) -> int:
    from halfmoon.cluster.client.grpc_client import Client, ServerError

    try:
        client = Client(args.server, args.tls_ca, api_key=args.api_key)
        if args.explain:
            print(client.explain(args.explain))
            return 0
        info = client.server_info()
    except ServerError as error:
        print(f"halfmoon status: {error}", file=sys.stderr)
        return 1
    data = info.details
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"mode {data['mode']}  model {data['model']}  policy {data['policy']}  "
        f"in flight {data['in_flight']}"
    )
    for name, load in sorted(data["workers"].items()):
        print(f"  {name:<12} " + "  ".join(f"{k}={v}" for k, v in load.items()))
    for name, tiers in data.get("stores", {}).items():
        print(f"  store {name[-12:]}: " + json.dumps(tiers))
    return 0


def _add_init_model(commands) -> None:
    # No torch: the module imports it when writing.
    from halfmoon.engine.init_model import ARCHES, SHAPES

    cmd = commands.add_parser(
        "init-model",
        help="write the tiny default Llama checkpoint (or another architecture's) to DIR",
        description="Write a tiny checkpoint (byte-level tokenizer, seeded random weights, chat "
        "template) loadable by transformers and halfmoon: Llama by default, or a mixture of "
        "experts (--arch).",
    )
    cmd.add_argument("dir", help="new directory to write the checkpoint into")
    cmd.add_argument(
        "--arch",
        choices=list(ARCHES),
        default="llama",
        help="llama (dense, the default); mixtral, qwen2-moe (with a shared expert), qwen3-moe: "
        "mixtures of experts, as transformers' Mixtral/Qwen2Moe/Qwen3Moe classes write them",
    )
    cmd.add_argument(
        "--shape",
        choices=list(SHAPES),
        default=None,
        help="tiny (~1M params, the dense default), bench (~50M), launch (~4M in 32 layers: "
        "launch-bound), gpu (~0.9B), wide-vocab (tiny at Qwen2's 151,936-row vocabulary); "
        "with experts: tiny-moe (~0.3M, the MoE default), moe (~52M total, 2 of 32 experts "
        "per token)",
    )
    cmd.add_argument("--seed", type=int, default=0, help="weight seed (0)")
    cmd.set_defaults(run=_run_init_model)


def _add_generate(commands) -> None:
    cmd = commands.add_parser(
        "generate",
        help="generate text for one prompt (from a server, or --local)",
        description="Stream the completion of PROMPT. With --local the engine runs in this "
        "process; otherwise the request goes to a running `halfmoon serve`.",
    )
    cmd.add_argument("prompt")
    cmd.add_argument("--local", action="store_true", help="run the engine in this process")
    cmd.add_argument("--model", help="checkpoint directory for --local (default: tiny model)")
    cmd.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="T",
        help="with --local: split the model across T ranks, one process each (1)",
    )
    cmd.add_argument("--server", default="127.0.0.1:50051", help="server host:port")
    add_tls_ca(cmd)
    cmd.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (64)")
    cmd.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    cmd.add_argument("--top-p", type=float, default=1.0)
    cmd.add_argument("--top-k", type=int, default=-1)
    cmd.add_argument("--seed", type=int, default=None)
    cmd.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    cmd.add_argument("--ignore-eos", action="store_true")
    add_api_key(cmd, "the server's API key")
    cmd.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (request_id, token_ids, text, finish_reason, usage); "
        "otherwise the text streams to stdout and the request id goes to stderr",
    )
    cmd.set_defaults(run=_run_generate)


def _run_init_model(args) -> int:
    from halfmoon.engine.init_model import ARCHES, SHAPES, init_model

    shape = args.shape or ("tiny" if args.arch == "llama" else "tiny-moe")
    path = init_model(args.dir, SHAPES[shape], seed=args.seed, arch=args.arch)
    print(f"wrote a {shape} {ARCHES[args.arch]} checkpoint to {path}")
    return 0


def sampling_kwargs(args) -> dict:
    """The sampling flags of `generate`, as SamplingParams keyword arguments."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    return {name: getattr(args, name) for name in names}


def _run_generate(args) -> int:
    if not args.local:
        from halfmoon.cluster.client.generate_remote import generate_remote

        return generate_remote(args)
    from halfmoon.engine import EngineConfig, LLMEngine, SamplingParams
    from halfmoon.engine.model_source import resolve_model

    params = SamplingParams(**sampling_kwargs(args))
    model, ranks = str(resolve_model(args.model)), args.tensor_parallel_size
    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=ranks))
    request_id = engine.add_request(args.prompt, params)
    token_ids, text, last = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids += out.new_token_ids
            text += out.new_text
            last = out
            if not args.json:
                print(out.new_text, end="", flush=True)
    print_result(request_id, token_ids, text, last, args.json)
    return 0


def print_result(request_id: str, token_ids: list[int], text: str, last, as_json: bool) -> None:
    """End `generate`'s output: the JSON object, or a newline and the request id on stderr."""
    if as_json:
        print(json.dumps(completion_json(request_id, token_ids, text, last)))
        return
    print()
    print(f"request id: {request_id}", file=sys.stderr)


def completion_json(request_id: str, token_ids: list[int], text: str, last) -> dict:
    """The shape `generate --json` prints, the same locally and from a server."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "text": text,
        "finish_reason": last.finish_reason,
        "usage": {
            "prompt_tokens": last.num_prompt_tokens,
            "completion_tokens": len(token_ids),
            "cached_tokens": last.num_cached_tokens,
        },
    }


def _forward(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and len(argv) >= 2 and argv[1] in BENCHMARKS:
        return _forward(BENCHMARKS[argv[1]], argv[2:])
    if argv[:1] and argv[0] in FORWARDED:
        return _forward(FORWARDED[argv[0]], argv[1:])
    args = build_parser().parse_args(argv)
    from halfmoon.cluster.config import ConfigError
    from halfmoon.engine.errors import HalfmoonError

    try:
        return args.run(args)
    except (HalfmoonError, ConfigError) as error:
        print(f"halfmoon {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
