"""`halfmoon bench cpu-linear`: the linear layers' GEMMs of the CPU benchmark model as the
engine runs them (`engine/cpu_linear.py`: decode rows through `kernels/cpu_gemm.py`, bf16 on AMX
tiles, fp32 and bf16 on AVX-512 or AVX2 vectors, where the CPU has them) against the path
without cpu_gemm, at each row count and thread count: oneDNN's prepacked GEMM where it serves
the dtype (for fp32 at up to `PLAIN_ROWS` rows MKL over the plain weight), else `F.linear`."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.bench.options import bench_parser
from halfmoon.engine import cpu_linear
from halfmoon.engine.init_model import SHAPES
from halfmoon.kernels import cpu_build


def layer_weights(shape, layers: int, dtype: torch.dtype) -> list[list[nn.Linear]]:
    """Each layer's four GEMMs (qkv, o, gate_up, down) of `shape`, random, as `nn.Linear`s
    (each with `.packed`, its `PackedLinear`); `layers` distinct copies, so that the weights
    come from memory as in a step."""
    head_dim = shape.hidden_size // shape.num_attention_heads
    qkv = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * head_dim
    sizes = [
        (shape.hidden_size, qkv),
        (shape.hidden_size, shape.hidden_size),
        (shape.hidden_size, 2 * shape.intermediate_size),
        (shape.intermediate_size, shape.hidden_size),
    ]
    result = []
    for _ in range(layers):
        linears = [nn.Linear(i, o, bias=False, dtype=dtype) for i, o in sizes]
        for linear in linears:
            linear.packed = cpu_linear.PackedLinear(linear)
        result.append(linears)
    return result


def time_layers(layers, rows: int, ours: bool, repeats: int) -> float:
    """Median ms of one pass over every layer's GEMMs at `rows` rows: the engine's path (`ours`)
    or the one without cpu_gemm (`tile_rows` 0: oneDNN; fp32 at up to `PLAIN_ROWS` rows MKL;
    `F.linear` where oneDNN does not serve the dtype)."""
    dtype = layers[0][0].weight.dtype
    inputs = [torch.randn(rows, linear.in_features, dtype=dtype) for linear in layers[0]]
    onednn = layers[0][0].packed.weight is not None
    small = dtype == torch.float32 and rows <= cpu_linear.PLAIN_ROWS
    plain = not ours and (small or not onednn)
    kept = [linear.packed.tile_rows for layer in layers for linear in layer]
    for layer in layers:
        for linear in layer:
            linear.packed.tile_rows = linear.packed.tile_rows if ours else 0
    try:
        passes = []
        for attempt in range(repeats + 2):  # two untimed
            started = time.perf_counter()
            for layer in layers:
                for linear, x in zip(layer, inputs, strict=True):
                    if plain:
                        F.linear(x, linear.weight)
                    else:
                        linear.packed(x)
            if attempt >= 2:
                passes.append((time.perf_counter() - started) * 1e3)
        return statistics.median(passes)
    finally:
        packed = (linear.packed for layer in layers for linear in layer)
        for layer_packed, tile_rows in zip(packed, kept, strict=True):
            layer_packed.tile_rows = tile_rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        "cpu-linear",
        description="The GEMMs of the ~50M CPU benchmark model's layers, at decode's row "
        "counts: the engine's path (kernels/cpu_gemm.py where the CPU serves it: bf16 on AMX "
        "tiles, fp32 and bf16 on AVX-512 or AVX2 vectors) against the path without it "
        "(oneDNN's prepacked GEMM where it serves the dtype, fp32 at 1-3 rows MKL over the "
        "plain weight, else F.linear), one after the other at each setting; prints each one's "
        "median ms a pass over all layers and before / ours. HALFMOON_CPU_ISA=avx2 runs what "
        "an AVX2 CPU runs.",
    )
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 16, 32, 64, 128],
        help="rows a GEMM multiplies: decode's sequences in a step (1 16 32 64 128)",
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="(1 2)")
    parser.add_argument(
        "--layers",
        type=int,
        default=SHAPES["bench"].num_hidden_layers,
        help="layers of distinct weights (the model's, %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed passes each (median)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="(%(default)s)"
    )
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or min(args.threads) < 1 or args.layers < 1 or args.repeats < 1:
        parser.error("--rows, --threads, --layers and --repeats take counts of 1 or more")
    layers = layer_weights(SHAPES["bench"], args.layers, getattr(torch, args.dtype))
    tiled = layers[0][0].packed.tiles is not None
    path = layers[0][0].packed.path
    if not tiled:
        print(f"no cpu_gemm kernel for {args.dtype} here: both sides take the path before")
    threads_before, results = torch.get_num_threads(), []
    try:
        with torch.inference_mode():
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    ours = time_layers(layers, rows, True, args.repeats)
                    before = time_layers(layers, rows, False, args.repeats)
                    results.append(
                        {
                            "threads": threads,
                            "rows": rows,
                            "ours_ms": ours,
                            "before_ms": before,
                            "ratio": before / ours,
                        }
                    )
    finally:
        torch.set_num_threads(threads_before)
    if args.json:
        report = {"dtype": args.dtype, "tiled": tiled, "path": path, "layers": args.layers}
        report["kernels"] = cpu_build.report()
        print(json.dumps(report | {"results": results}))
        return 0
    print(f"our path: {path} (the {cpu_build.current().name} kernels)")
    print(f"{'threads':>7} {'rows':>5} {'ours ms':>9} {'before ms':>10} {'before / ours':>14}")
    for r in results:
        print(
            f"{r['threads']:>7} {r['rows']:>5} {r['ours_ms']:>9.2f} {r['before_ms']:>10.2f} "
            f"{r['ratio']:>13.2f}x"
        )
    return 0
