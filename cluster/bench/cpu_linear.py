"""`halfmoon bench cpu-linear`: the linear layers' GEMMs of the CPU benchmark model as the
engine runs them (`engine/cpu_linear.py`: bf16 decode rows on AMX tiles where the CPU has them)
against oneDNN's prepacked GEMM alone, the path before, at each row count and thread count."""

from __future__ import annotations

import json
import statistics
import time

import torch
from torch import nn

from halfmoon.cluster.bench.options import bench_parser
from halfmoon.engine import cpu_linear
from halfmoon.engine.init_model import SHAPES


def layer_weights(shape, layers: int, dtype: torch.dtype) -> list[list[cpu_linear.PackedLinear]]:
    """Each layer's four GEMMs (qkv, o, gate_up, down) of `shape`, random, packed as the engine
    packs them; `layers` distinct copies, so that the weights come from memory as in a step."""
    head_dim = shape.hidden_size // shape.num_attention_heads
    qkv = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * head_dim
    sizes = [
        (shape.hidden_size, qkv),
        (shape.hidden_size, shape.hidden_size),
        (shape.hidden_size, 2 * shape.intermediate_size),
        (shape.intermediate_size, shape.hidden_size),
    ]
    return [
        [cpu_linear.PackedLinear(nn.Linear(i, o, bias=False, dtype=dtype)) for i, o in sizes]
        for _ in range(layers)
    ]


def time_layers(layers, rows: int, tile_rows: int, repeats: int) -> float:
    """Median ms of one pass over every layer's GEMMs at `rows` rows, with the engine's
    `TILE_ROWS` set to `tile_rows` (0: oneDNN at every row count)."""
    inputs = [torch.randn(rows, gemm.weight.shape[1], dtype=torch.bfloat16) for gemm in layers[0]]
    before = cpu_linear.TILE_ROWS
    cpu_linear.TILE_ROWS = tile_rows
    try:
        passes = []
        for attempt in range(repeats + 2):  # two untimed
            started = time.perf_counter()
            for layer in layers:
                for gemm, x in zip(layer, inputs, strict=True):
                    gemm(x)
            if attempt >= 2:
                passes.append((time.perf_counter() - started) * 1e3)
        return statistics.median(passes)
    finally:
        cpu_linear.TILE_ROWS = before


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        "cpu-linear",
        description="The bf16 GEMMs of the ~50M CPU benchmark model's layers, at decode's row "
        "counts: the engine's path (AMX tiles up to TILE_ROWS rows, where the CPU has them) "
        "against oneDNN's prepacked GEMM alone, one after the other at each setting; prints each "
        "one's median ms a pass over all layers and oneDNN / ours.",
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128],
        help="rows a GEMM multiplies: decode's sequences in a step (1 16 32 64 128)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="(1 2)")
    parser.add_argument(
        "--layers", type=int, default=SHAPES["bench"].num_hidden_layers,
        help="layers of distinct weights (the model's, %(default)s)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=7, help="timed passes each (median)")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or min(args.threads) < 1 or args.layers < 1 or args.repeats < 1:
        parser.error("--rows, --threads, --layers and --repeats take counts of 1 or more")
    layers = layer_weights(SHAPES["bench"], args.layers, torch.bfloat16)
    tiled = layers[0][0].tiles is not None
    if not tiled:
        print("no AMX here (or no C++ compiler): both sides are oneDNN", flush=True)
    threads_before, results = torch.get_num_threads(), []
    try:
        with torch.inference_mode():
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    ours = time_layers(layers, rows, cpu_linear.TILE_ROWS, args.repeats)
                    onednn = time_layers(layers, rows, 0, args.repeats)
                    results.append(
                        {"threads": threads, "rows": rows, "ours_ms": ours,
                         "onednn_ms": onednn, "ratio": onednn / ours}
                    )  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    if args.json:
        print(json.dumps({"amx_tiles": tiled, "layers": args.layers, "results": results}))
        return 0
    print(f"{'threads':>7} {'rows':>5} {'ours ms':>9} {'oneDNN ms':>10} {'oneDNN / ours':>14}")
    for r in results:
        print(f"{r['threads']:>7} {r['rows']:>5} {r['ours_ms']:>9.2f} {r['onednn_ms']:>10.2f} "
              f"{r['ratio']:>13.2f}x")  # fmt: skip
    return 0
