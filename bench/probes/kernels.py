"""`halfmoon bench kernels`: time each Triton kernel on CUDA against the device's peak and torch."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from types import ModuleType

import torch
import torch.nn.functional as F

from halfmoon.bench.options import bench_parser
from halfmoon.kernels import ops, reference

NO_CUDA = (
    "no CUDA device: kernel benchmarks need a GPU; CPU correctness is covered by tests/kernels"
)
COPY_BYTES = 1 << 30
MATMUL_SIZE = 8192

Timer = Callable[[Callable[[], object], int, int], float]


def _option(default: int, help_: str):
    """A `BenchConfig` field that is also an option of `halfmoon bench kernels`."""
    return field(default=default, metadata={"help": help_})


@dataclass(slots=True)
class BenchConfig:
    """Workload shapes (decode batch x context, prefill batch x length) and timing repeats."""

    decode_batch: int = _option(64, "sequences in the decode workload")
    decode_context: int = _option(4096, "cached tokens per decoding sequence")
    prefill_batch: int = _option(8, "runs in the prefill workload")
    prefill_len: int = _option(2048, "new tokens per prefill run")
    num_q_heads: int = _option(32, "query heads")
    num_kv_heads: int = _option(8, "KV heads")
    head_dim: int = _option(128, "head dimension")
    block_size: int = _option(16, "tokens per KV page")
    warmup: int = _option(5, "untimed calls before timing")
    iters: int = _option(20, "timed calls averaged")


@dataclass(slots=True)
class DevicePeaks:
    """What the device can do at best, and where each number came from."""

    bandwidth_gbs: float
    bandwidth_source: str
    tflops: float
    tflops_source: str


@dataclass(slots=True)
class KernelResult:
    """One kernel's timing, its throughput, and how it compares with the peak and with torch."""

    kernel: str
    shape: str
    triton_ms: float
    torch_ms: float
    unit: str
    achieved: float
    fraction_of_peak: float
    speedup_vs_torch: float


@dataclass(slots=True)
class Case:
    """A workload: the Triton call, the torch baseline, and the bytes or FLOPs one call does."""

    kernel: str
    shape: str
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    work: float
    unit: str


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean milliseconds per call of `fn`, measured with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_peaks(device: torch.device, timer: Timer = time_ms) -> DevicePeaks:
    """Bandwidth from the memory clock and bus width when torch exposes them, else a big copy."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per clock.
        bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
        source = "device properties (memory clock x bus width)"
    else:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = timer(lambda: dst.copy_(src), 3, 10)
        bandwidth = 2 * COPY_BYTES / (ms * 1e-3) / 1e9
        source = "measured 1 GiB device-to-device copy"
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, dtype=torch.float16, device=device)
    ms = timer(lambda: a @ a, 3, 10)
    tflops = 2 * MATMUL_SIZE**3 / (ms * 1e-3) / 1e12
    return DevicePeaks(bandwidth, source, tflops, f"measured {MATMUL_SIZE}^3 fp16 matmul")


def _paged_cache(num_seqs: int, seq_len: int, config: BenchConfig, device: torch.device):
    """Shuffled K/V pages for `num_seqs` sequences of `seq_len` tokens, plus dense copies."""
    pages_per_seq = math.ceil(seq_len / config.block_size)
    shape = (num_seqs * pages_per_seq, config.block_size, config.num_kv_heads, config.head_dim)
    k_cache = torch.randn(shape, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(shape[0], device=device)
    tables = order.view(num_seqs, pages_per_seq).to(torch.int32)

    def dense(cache: torch.Tensor) -> torch.Tensor:
        return cache[tables.long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()

    return k_cache, v_cache, tables, dense(k_cache), dense(v_cache)


def decode_case(kernels: ModuleType, config: BenchConfig, device: torch.device) -> Case:
    """Decode: one query per sequence over `decode_context` paged tokens; bytes are the KV read."""
    batch, context = config.decode_batch, config.decode_context
    k_cache, v_cache, tables, keys, values = _paged_cache(batch, context, config, device)
    query = torch.randn(
        batch, config.num_q_heads, config.head_dim, dtype=torch.float16, device=device
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = config.head_dim**-0.5
    kv_bytes = 2 * batch * context * config.num_kv_heads * config.head_dim * k_cache.element_size()
    return Case(
        "paged_decode_attention",
        f"{batch} seqs x {context} ctx",
        lambda: kernels.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, scale),
        lambda: F.scaled_dot_product_attention(
            query.unsqueeze(2), keys, values, scale=scale, enable_gqa=True
        ),
        kv_bytes + 2 * query.numel() * query.element_size(),
        "GB/s",
    )


def prefill_case(kernels: ModuleType, config: BenchConfig, device: torch.device) -> Case:
    """Prefill: `prefill_batch` runs of `prefill_len` new tokens, causal, no cached prefix."""
    batch, length, heads = config.prefill_batch, config.prefill_len, config.num_q_heads
    k_cache, v_cache, tables, keys, values = _paged_cache(batch, length, config, device)
    query = torch.randn(batch * length, heads, config.head_dim, dtype=torch.float16, device=device)
    dense_query = query.view(batch, length, heads, -1).transpose(1, 2)
    cu_seqlens = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * length
    prefix_lens = torch.zeros(batch, dtype=torch.int32, device=device)
    scale = config.head_dim**-0.5
    # Causal: each query sees (i + 1) keys; QK^T and PV are 2 FLOPs per multiply-add each.
    flops = 4 * batch * heads * config.head_dim * length * (length + 1) / 2
    return Case(
        "prefill_attention",
        f"{batch} runs x {length} tokens",
        lambda: kernels.prefill_attention(
            query, k_cache, v_cache, cu_seqlens, tables, prefix_lens, scale
        ),
        lambda: F.scaled_dot_product_attention(
            dense_query, keys, values, is_causal=True, scale=scale, enable_gqa=True
        ),
        flops,
        "TFLOP/s",
    )


def engine_prefill_case(config: BenchConfig, device: torch.device) -> Case:
    """The prefill workload as the engine runs it: runs with no cached prefix go to
    `ops.causal_attention` (torch's fused attention per run, over the step's own K/V), not to
    the paged kernel; the torch side is one batched SDPA call over the same dense K/V."""
    batch, length, heads = config.prefill_batch, config.prefill_len, config.num_q_heads
    shape = (batch * length, config.num_kv_heads, config.head_dim)
    query = torch.randn(batch * length, heads, config.head_dim, dtype=torch.float16, device=device)
    key = torch.randn(shape, dtype=torch.float16, device=device)
    value = torch.randn_like(key)

    def dense(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, length, x.shape[1], -1).transpose(1, 2)

    scale = config.head_dim**-0.5
    flops = 4 * batch * heads * config.head_dim * length * (length + 1) / 2
    return Case(
        "prefill_engine_dispatch",
        f"{batch} runs x {length} tokens",
        lambda: ops.causal_attention(query, key, value, [length] * batch, scale),
        lambda: F.scaled_dot_product_attention(
            dense(query), dense(key), dense(value), is_causal=True, scale=scale, enable_gqa=True
        ),
        flops,
        "TFLOP/s",
    )


def memory_cases(kernels: ModuleType, config: BenchConfig, device: torch.device) -> list[Case]:
    """The bandwidth-bound kernels over as many tokens as the prefill workload."""
    tokens = config.prefill_batch * config.prefill_len
    kv_heads, head_dim = config.num_kv_heads, config.head_dim
    k_cache, v_cache, tables, _, _ = _paged_cache(
        config.prefill_batch, config.prefill_len, config, device
    )
    key = torch.randn(tokens, kv_heads, head_dim, dtype=torch.float16, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(k_cache.shape[0] * config.block_size, device=device)[:tokens]
    page_ids = tables.flatten()
    buffer = reference.gather_pages(k_cache, page_ids)
    hidden = config.num_q_heads * head_dim
    x = torch.randn(tokens, hidden, dtype=torch.float16, device=device)
    residual, weight = torch.randn_like(x), torch.randn(hidden, dtype=torch.float16, device=device)
    query = torch.randn(tokens, config.num_q_heads, head_dim, dtype=torch.float16, device=device)
    positions = torch.arange(tokens, device=device) % config.prefill_len
    angles = torch.rand(config.prefill_len, head_dim // 2, device=device) * 2 * math.pi
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    row_bytes = key.numel() * key.element_size()
    page_bytes = buffer.numel() * buffer.element_size()
    x_bytes = x.numel() * x.element_size()
    qk_bytes = (query.numel() + key.numel()) * key.element_size()
    shape = f"{tokens} tokens"

    def both(fn_name: str, *args) -> tuple[Callable[[], object], Callable[[], object]]:
        return (
            lambda: getattr(kernels, fn_name)(*args),
            lambda: getattr(reference, fn_name)(*args),
        )

    return [
        Case(
            "store_kv",
            shape,
            *both("store_kv", key, value, k_cache, v_cache, slots),
            4 * row_bytes,
            "GB/s",
        ),
        Case(
            "gather_pages",
            f"{page_ids.numel()} pages",
            *both("gather_pages", k_cache, page_ids),
            2 * page_bytes,
            "GB/s",
        ),
        Case(
            "scatter_pages",
            f"{page_ids.numel()} pages",
            *both("scatter_pages", k_cache, page_ids, buffer),
            2 * page_bytes,
            "GB/s",
        ),
        Case(
            "rms_norm",
            f"{tokens} x {hidden}",
            *both("rms_norm", x, weight, 1e-6, residual),
            4 * x_bytes,
            "GB/s",
        ),
        Case(
            "rotary_embedding",
            shape,
            *both("rotary_embedding", positions, query, key, cos_sin),
            2 * qk_bytes,
            "GB/s",
        ),
    ]


def run_cases(
    kernels: ModuleType,
    config: BenchConfig,
    device: torch.device,
    peaks: DevicePeaks,
    timer: Timer = time_ms,
) -> list[KernelResult]:
    """Build every workload on `device`, time both sides, and relate the Triton side to the peak."""
    cases = [decode_case(kernels, config, device), prefill_case(kernels, config, device)]
    cases.append(engine_prefill_case(config, device))
    cases += memory_cases(kernels, config, device)
    results = []
    for case in cases:
        triton_ms = timer(case.run_triton, config.warmup, config.iters)
        torch_ms = timer(case.run_torch, config.warmup, config.iters)
        scale = 1e12 if case.unit == "TFLOP/s" else 1e9
        achieved = case.work / (triton_ms * 1e-3) / scale
        peak = peaks.tflops if case.unit == "TFLOP/s" else peaks.bandwidth_gbs
        results.append(
            KernelResult(
                case.kernel,
                case.shape,
                triton_ms,
                torch_ms,
                case.unit,
                achieved,
                achieved / peak,
                torch_ms / triton_ms,
            )
        )
    return results


def format_table(device_name: str, peaks: DevicePeaks, results: list[KernelResult]) -> str:
    """A human-readable report naming the device and where each peak came from."""
    lines = [
        f"device: {device_name}",
        f"peak bandwidth: {peaks.bandwidth_gbs:.0f} GB/s ({peaks.bandwidth_source})",
        f"peak compute: {peaks.tflops:.0f} TFLOP/s ({peaks.tflops_source})",
        f"{'kernel':<24}{'shape':<26}{'triton ms':>10}{'torch ms':>10}"
        f"{'achieved':>18}{'of peak':>9}{'vs torch':>10}",
    ]
    for r in results:
        lines.append(
            f"{r.kernel:<24}{r.shape:<26}{r.triton_ms:>10.3f}{r.torch_ms:>10.3f}"
            f"{r.achieved:>10.1f} {r.unit:<7}{r.fraction_of_peak:>8.0%}{r.speedup_vs_torch:>9.2f}x"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `halfmoon bench kernels`."""
    parser = bench_parser(
        "kernels",
        description="Time the Triton kernels on the CUDA device (fp16) and report achieved GB/s or "
        "TFLOP/s, the fraction of the device's peak, and the speedup over the torch baseline "
        "(scaled_dot_product_attention over already-gathered dense KV for attention, the "
        "reference kernels otherwise). Without CUDA it prints why and exits 0.",
    )
    for option in fields(BenchConfig):
        parser.add_argument(
            f"--{option.name.replace('_', '-')}",
            type=int,
            default=option.default,
            help=f"{option.metadata['help']} (default {option.default})",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the kernel benchmarks, or explain why they cannot run here."""
    args = build_parser().parse_args(argv)
    config = BenchConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    if not torch.cuda.is_available():
        print(json.dumps({"device": None, "skipped": NO_CUDA}) if args.json else NO_CUDA)
        return 0
    from halfmoon.kernels import triton_kernels

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peaks = measure_peaks(device)
    results = run_cases(triton_kernels, config, device, peaks)
    if args.json:
        report = {
            "device": name,
            "peaks": asdict(peaks),
            "config": asdict(config),
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_table(name, peaks, results))
    return 0
