"""One line of figures from a `bench step` or `bench engine --json` log (its last line is the
JSON), for deploy/gpu/visit.sh's summary: `bench_figures.py LOG`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(result: dict) -> str:
    if "steps" in result:  # bench step
        return "; ".join(
            f"batch {batch}: wall {step['wall_ms']:.2f} ms, {_ratio(step['wall_over_kernel'])}"
            for batch, step in result["steps"].items()
        )
    return (
        f"{result['ours_tok_s']:.0f} tok/s, {result['ratio_vs_hf_static']:.2f}x transformers static"
    )


def _ratio(wall_over_kernel: float | None) -> str:
    if wall_over_kernel is None:  # on CPU: no kernel timing
        return "no kernel timing"
    return f"{wall_over_kernel:.2f}x its kernels"


def main(argv: list[str]) -> int:
    lines = Path(argv[0]).read_text().strip().splitlines() if Path(argv[0]).exists() else []
    try:
        print(figures(json.loads(lines[-1])))
    except (IndexError, ValueError, KeyError, TypeError):
        print(f"no figures: {argv[0]} does not end in a result")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
