"""What the live-cluster benchmarks share about where they run: `--device cpu|cuda` (and their
prompts' `--seed`), and on a GPU the setup of the issues' measurements (bf16, both workers
sharing the one GPU)."""

from __future__ import annotations

import argparse

import torch

from halfmoon.engine.init_model import SHAPES, default_model_dir, ensure_model

# Both workers on the one GPU, as in the GPU issues' measurements.
SHARED_GPU_SETTINGS = {"engine.dtype": "bfloat16", "prefill.num_gpus": 0.3, "decode.num_gpus": 0.3}


def add_device_options(parser: argparse.ArgumentParser, on_cpu: str) -> None:
    """`--device`, cuda by default when torch sees a GPU (`on_cpu` says what runs on cpu), and
    `--model`, a checkpoint instead of the device's own."""
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help=f"cpu: {on_cpu}; cuda: the ~0.9B shape of the GPU issues in bf16, both workers "
        "sharing the GPU (default: cuda when one is visible)",
    )
    parser.add_argument(
        "--model",
        help="checkpoint directory (default: by --device), or launch-bound: a generated model of "
        "32 layers of width 128, whose prefill is per-layer host work as an eager GPU one is",
    )


def parse_device_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, on_cpu: str
) -> argparse.Namespace:
    """`argv` parsed with the device options and the prompts' `--seed` added; a usage error for
    `--device cuda` where torch sees no GPU."""
    add_device_options(parser, on_cpu)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    return args


def bench_model(device: str, model: str | None = None) -> str:
    """`model`, else the bench checkpoint for `device` (made on first use): the ~50M model on
    cpu, the ~0.9B shape of the GPU issues on cuda; "launch-bound": the generated 32-layer
    model of width 128."""
    if model == "launch-bound":  # generated: 32 thin layers, host-bound (SHAPES["launch"])
        return str(ensure_model(default_model_dir().with_name(model), SHAPES["launch"]))
    if model:
        return model
    name, shape = ("bench-0.9b", "gpu") if device == "cuda" else ("bench-50m", "bench")
    return str(ensure_model(default_model_dir().with_name(name), SHAPES[shape]))


def int_list(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """The whole numbers of a comma-separated option, or a usage error naming `flag`."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: give whole numbers separated by commas")


def live_bench_settings(model: str, device: str, **settings) -> dict:
    """Cluster settings of a live-cluster benchmark: `model` on free ports, no HTTP server,
    no local Redis, and on cuda both workers sharing the GPU; `settings` (dotted keys, as
    `--set` takes them) on top."""
    base = {
        "model": model,
        "server.grpc_port": 0,
        "server.metrics_port": 0,
        "server.http_port": "off",
        "store.use_local_redis": False,
    }
    if device == "cuda":
        base.update(SHARED_GPU_SETTINGS)
    return {**base, **settings}


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """A usage error for `--device cuda` where torch sees no GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch")
