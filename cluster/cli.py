"""The `halfmoon` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARKS = {
    "engine": "halfmoon.engine.bench",
    "kernels": "halfmoon.kernels.bench",
    "kvstore": "halfmoon.kvstore.bench",
    "router": "halfmoon.router.bench",
}


def _forward(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="halfmoon", description="halfmoon: a disaggregated LLM serving cluster."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = commands.add_parser("bench", help="run a benchmark (engine, kernels, kvstore, router)")
    bench.add_argument("target", choices=sorted(BENCHMARKS))
    commands.add_parser("simulate", help="simulate the router on a trace (see `simulate --help`)")
    if argv[:1] == ["bench"] and len(argv) >= 2 and argv[1] in BENCHMARKS:
        return _forward(BENCHMARKS[argv[1]], argv[2:])
    if argv[:1] == ["simulate"]:
        return _forward("halfmoon.router.simulate", argv[1:])
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
