"""`halfmoon bench step`: where a decode step's time goes, wall clock against GPU kernel time.

For each batch size it fills the engine with that many decoding sequences, times decode
steps on the wall clock, then profiles as many steps again and sums their device time. A
ratio near 1 means the GPU is busy the whole step; a large one means Python and launches
dominate. It also measures the device's copy bandwidth to price streaming the weights once,
the floor of a batch-1 decode step. Issue 13's goals: wall <= 1.3x kernel time, batch-1 step
<= 5x weight streaming.

`host_ms` is the same step with the model replaced by fixed outputs: scheduling, the input
copies, sampling and detokenization, what the host adds to a step on any device. A graphed
step can only reach 1.3x its kernel time if `host_ms` stays under 0.3x of it (nothing overlaps
the two yet). On CPU the engine runs the decode graphs' static buffers eagerly, as a GPU decode
engine does without capture, so `host_ms` measures that path.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from halfmoon.bench.device import check_device
from halfmoon.bench.engine import SETUPS, sync_device
from halfmoon.bench.options import bench_parser
from halfmoon.engine.init_model import default_model_dir, ensure_model
from halfmoon.engine.step_probe import host_step_time


def copy_bandwidth_bytes_s(device: str, num_bytes: int = 1 << 30) -> float:
    """Bytes per second moved by a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync_device(device)
    return 2 * 5 * num_bytes / (time.perf_counter() - started)


def decode_step_times(llm, batch_size: int, context: int, steps: int) -> tuple[float, float | None]:
    """(wall seconds, device seconds or None on CPU) per decode step at `batch_size`."""
    from halfmoon.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=10 * steps + 8, temperature=0.0, ignore_eos=True)
    vocab = engine.facts.vocab_size
    ids = [
        engine.add_request([(7 * i + j) % (vocab - 6) + 6 for j in range(context)], params)
        for i in range(batch_size)
    ]
    while any(engine.requests[rid].num_output_tokens == 0 for rid in ids):
        engine.step()
    for _ in range(3):  # warm: the first steps at a new width may compile
        engine.step()
    device = engine.device.type
    sync_device(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync_device(device)
    wall_s = (time.perf_counter() - started) / steps
    device_s = None
    if device == "cuda":
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync_device(device)
        device_us = sum(event.self_device_time_total for event in prof.key_averages())
        device_s = device_us / 1e6 / steps
    host_s = host_step_time(engine, len(ids), steps)
    for rid in ids:
        engine.abort(rid)
    return wall_s, device_s, host_s


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("step", __doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 64], help="decode batch sizes (1 64)"
    )
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per size")
    parser.add_argument("--eager", action="store_true", help="run without CUDA graphs")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    from halfmoon.engine import LLM

    setup = SETUPS[args.device]
    model_dir = ensure_model(default_model_dir().with_name(setup.model_name), setup.shape)
    llm = LLM(
        str(model_dir),
        device=args.device,
        dtype=str(setup.dtype).removeprefix("torch."),
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(2048, args.context),
        enforce_eager=args.eager,
    )
    if args.device == "cpu" and not args.eager:
        llm.engine.use_decode_buffers(capture=False)
    weights_s = llm.engine.weights_bytes / copy_bandwidth_bytes_s(args.device)
    result = {
        "device": args.device,
        "graphs": llm.engine.decode_buffers_in_use,
        "weights_stream_ms": weights_s * 1e3,
        "steps": {},
    }
    for size in args.batch_sizes:
        wall_s, device_s, host_s = decode_step_times(llm, size, args.context, args.steps)
        result["steps"][size] = {
            "wall_ms": wall_s * 1e3,
            "kernel_ms": device_s * 1e3 if device_s else None,
            "host_ms": host_s * 1e3,
            "wall_over_kernel": wall_s / device_s if device_s else None,
            "host_over_kernel": host_s / device_s if device_s else None,
            "wall_over_weights_stream": wall_s / weights_s,
        }
        print(f"batch {size}: {result['steps'][size]}", file=sys.stderr)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
