"""`halfmoon bench ttft`: where a served request's time to first token goes, against the
engine's own prefill of the same prompts, in one run.

The engine alone (in this process, no Ray, no gRPC) prefills each prompt first: that is the
baseline. Then a local cluster serves the same prompts over gRPC in each mode asked for, and
the router's timeline of every request (`halfmoon status --explain ID` shows the same) splits
the served TTFT into stages. Issue 13's goal is served TTFT p50 <= 2x the engine's prefill + 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import ray
import torch
from tqdm import tqdm

from halfmoon.bench.device import (
    SHARED_GPU_SETTINGS,
    bench_model,
    parse_device_args,
)
from halfmoon.bench.engine import sync_device
from halfmoon.bench.options import bench_parser
from halfmoon.cluster.client.grpc_client import AsyncClient
from halfmoon.cluster.config import ClusterConfig, load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.engine.init_model import ensure_model
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.router.sim.summary import percentile

GOAL_FACTOR, GOAL_SLACK_S = 2.0, 0.005


@dataclass(slots=True)
class ModeResult:
    """One serving mode: client-side TTFTs and the router's stage offsets (seconds)."""

    mode: str
    ttft_s: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    # Disaggregated: the prefill workers' time inside model forward passes, a request on
    # average (their `forward_s` over the run; one at a time, it is each request's own).
    engine_compute_s: float | None = None

    def split_ms(self) -> dict[str, float] | None:
        """Served TTFT's p50 parts: waiting for the prefill to start, the prefill worker's
        compute (its step with hooks and publishing), the engine's own forward passes within
        it, and the hand-off to the first token out."""
        stages = self.stages
        names = ("prefill compute began", "prefill compute ended", "first token out")
        if self.engine_compute_s is None or not all(stages.get(n) for n in names):
            return None
        began, ended, first = (stages[n] for n in names)
        worker = [end - start for start, end in zip(began, ended, strict=False)]
        hand_off = [token - end for end, token in zip(ended, first, strict=False)]
        return {
            "queue": statistics.median(began) * 1e3,
            "worker_compute": statistics.median(worker) * 1e3,
            "engine_compute": self.engine_compute_s * 1e3,
            "hand_off": statistics.median(hand_off) * 1e3,
        }

    def add_timeline(self, timeline: list[tuple[str, float]]) -> None:
        seen = set()
        for stage, offset_s in timeline:
            if stage not in seen:  # a retried request marks some stages twice: the first counts
                seen.add(stage)
                self.stages.setdefault(stage, []).append(offset_s)


def make_prompts(num: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no shared prefix: nothing is served from a cache)."""
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab_size) for _ in range(num_tokens)] for _ in range(num)]


def add_prompt_options(
    parser: argparse.ArgumentParser, prompt_tokens: int, max_tokens: int
) -> None:
    """--prompt-tokens, the length of each of `make_prompts`' prompts, and --max-tokens, of each
    request's output."""
    parser.add_argument(
        "--prompt-tokens", type=int, default=prompt_tokens, help="tokens per prompt (%(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="output tokens per request (%(default)s)"
    )


def cluster_config(model: str, mode: str, device: str) -> ClusterConfig:
    settings = {
        "model": model,
        "mode": mode,
        "server.grpc_port": 0,
        "server.metrics_port": 0,
        "server.http_port": None,
        "store.use_local_redis": False,
        "router.bypass_threshold_tokens": 0,  # every prompt takes the disaggregated path
        "router.admission": "none",
    }
    if device == "cuda":
        settings.update(SHARED_GPU_SETTINGS)
        settings.update({"engine.prefill_chunk_size": 2048, "engine.max_num_batched_tokens": 4096})
    return load_config(None, settings)


def engine_prefill_times(config: ClusterConfig, prompts: list[list[int]]) -> list[float]:
    """Seconds from add_request to the first token, one prompt at a time, in this process."""
    engine_config = config.engine.engine_config(config.model)
    engine = LLMEngine(engine_config)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first one warms up, uncounted
        started = time.perf_counter()
        engine.add_request(prompt, params, f"engine-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        sync_device(engine.device.type)
        if i:
            times.append(time.perf_counter() - started)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times


async def serve_prompts(
    address: str, prompts: list[list[int]], max_tokens: int, rate: float, bar
) -> list[tuple[str, float]]:
    """Send every prompt (one at a time when `rate` is 0, else Poisson at `rate` per second);
    returns (request id, client-side TTFT) per request."""
    rng = random.Random(1)
    async with AsyncClient(address) as client:

        async def one(i: int, prompt: list[int]) -> tuple[str, float]:
            started = time.perf_counter()
            stream = client.generate(prompt, max_tokens=max_tokens, temperature=0.0)
            ttft = None
            async for delta in stream:
                if ttft is None and delta.token_ids:
                    ttft = time.perf_counter() - started
            bar.update()
            return stream.request_id, ttft

        await one(-1, prompts[0][::-1])  # warm-up, uncounted
        if rate <= 0:
            return [await one(i, p) for i, p in enumerate(prompts)]
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(one(i, prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def serve_mode(config: ClusterConfig, prompts, max_tokens: int, rate: float, bar) -> ModeResult:
    cluster = Cluster(config)
    result = ModeResult(config.mode)
    try:
        ports = cluster.start()
        address = f"127.0.0.1:{ports['grpc_port']}"
        forward_before = _prefill_forward_s(cluster)
        served = asyncio.run(serve_prompts(address, prompts, max_tokens, rate, bar))
        if config.mode == "disaggregated":  # (a colocated worker's forward passes decode too)
            forward_s = _prefill_forward_s(cluster) - forward_before
            result.engine_compute_s = forward_s / (len(prompts) + 1)  # the warm-up's too
        for request_id, ttft_s in served:
            result.ttft_s.append(ttft_s)
            result.add_timeline(ray.get(cluster.router.timeline.remote(request_id)))
    finally:
        cluster.stop()
    return result


def _prefill_forward_s(cluster: Cluster) -> float:
    """The prefill workers' seconds inside model forward passes so far."""
    prefills = [w.actor for w in cluster.workers.values() if w.kind == "prefill"]
    return sum(c["forward_s"] for c in ray.get([a.counters.remote() for a in prefills]))


def report(engine_s: list[float], results: list[ModeResult], args) -> dict:
    engine_p50 = statistics.median(engine_s)
    goal_s = GOAL_FACTOR * engine_p50 + GOAL_SLACK_S
    out = {
        "device": args.device,
        "prompt_tokens": args.prompt_tokens,
        "requests": args.requests,
        "request_rate": args.request_rate,
        "engine_prefill_p50_ms": engine_p50 * 1e3,
        "goal_ttft_p50_ms": goal_s * 1e3,
        "modes": {},
    }
    for result in results:
        ttft_p50 = statistics.median(result.ttft_s)
        medians = {stage: statistics.median(offsets) for stage, offsets in result.stages.items()}
        stages = {stage: medians[stage] * 1e3 for stage in sorted(medians, key=medians.get)}
        out["modes"][result.mode] = {
            "ttft_p50_ms": ttft_p50 * 1e3,
            "ttft_p99_ms": percentile(sorted(result.ttft_s), 0.99) * 1e3,
            "ttft_over_engine": ttft_p50 / engine_p50,
            "overhead_p50_ms": (ttft_p50 - engine_p50) * 1e3,
            "goal_met": ttft_p50 <= goal_s,
            "stages_p50_ms": stages,
            "split_p50_ms": result.split_ms(),
        }
    return out


def print_report(out: dict) -> None:
    pace = f"{out['request_rate']} req/s" if out["request_rate"] else "one at a time"
    print(
        f"halfmoon bench ttft: {out['requests']} prompts of {out['prompt_tokens']} tokens on "
        f"{out['device']}, {pace}"
    )
    print(f"engine alone, prefill p50: {out['engine_prefill_p50_ms']:.2f} ms")
    print(f"goal: served TTFT p50 <= 2x that + 5 ms = {out['goal_ttft_p50_ms']:.2f} ms")
    for mode, m in out["modes"].items():
        print(f"\n{mode}: TTFT p50 {m['ttft_p50_ms']:.2f} ms, p99 {m['ttft_p99_ms']:.2f} ms")
        print(
            f"  {m['ttft_over_engine']:.2f}x the engine alone ({m['overhead_p50_ms']:+.2f} ms); "
            f"goal {'met' if m['goal_met'] else 'missed'}"
        )
        if split := m.get("split_p50_ms"):
            worker, engine = split["worker_compute"], split["engine_compute"]
            print(
                f"  split p50: queue {split['queue']:.2f} ms, prefill worker compute "
                f"{worker:.2f} ms (engine forward {engine:.2f} ms, {worker / engine:.2f}x), "
                f"hand-off {split['hand_off']:.2f} ms"
            )
        print("  router timeline p50 (ms since arrival):")
        for stage, offset in m["stages_p50_ms"].items():
            print(f"    {offset:9.2f}  {stage}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        "ttft",
        "Served time to first token against the engine's own prefill of the same "
        "prompts, in one run: the engine alone in this process, then a local cluster over gRPC "
        "per mode, with the router's per-request timeline split into stages (the median of each).",
    )
    parser.add_argument(
        "--mode",
        choices=["both", "disaggregated", "colocated"],
        default="both",
        help="serving modes to measure (%(default)s)",
    )
    parser.add_argument("--requests", type=int, default=16, help="prompts per mode (%(default)s)")
    add_prompt_options(parser, prompt_tokens=256, max_tokens=8)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second; 0 sends one at a time (%(default)s)",
    )
    args = parse_device_args(parser, argv, on_cpu="the tiny model, fp32")
    if args.requests < 1 or args.prompt_tokens < 1 or args.max_tokens < 1:
        parser.error("--requests, --prompt-tokens and --max-tokens must be at least 1")
    if args.model or args.device == "cuda":
        model = bench_model(args.device, args.model)
    else:
        model = str(ensure_model())  # the tiny serving default, not the ~50M bench model
    modes = ["disaggregated", "colocated"] if args.mode == "both" else [args.mode]
    configs = [cluster_config(model, mode, args.device) for mode in modes]
    limit = configs[0].engine.max_model_len
    if limit is not None and args.prompt_tokens + args.max_tokens > limit:
        parser.error(f"--prompt-tokens + --max-tokens must fit the context ({limit})")
    vocab_size = _vocab_size(model)
    prompts = make_prompts(args.requests, args.prompt_tokens, vocab_size, args.seed)
    if args.device == "cpu":
        torch.set_num_threads(int(max(1, configs[0].prefill.num_cpus)))  # a worker's threads
    engine_s = engine_prefill_times(configs[0], prompts)
    bar = tqdm(total=len(modes) * (args.requests + 1), desc="served", file=sys.stderr)
    results = [serve_mode(c, prompts, args.max_tokens, args.request_rate, bar) for c in configs]
    bar.close()
    out = report(engine_s, results, args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_report(out)
    return 0


def _vocab_size(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


if __name__ == "__main__":
    sys.exit(main())
