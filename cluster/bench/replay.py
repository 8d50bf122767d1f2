"""`halfmoon bench replay`: replay a Mooncake trace on the live local cluster, and the
simulator on the same scaled trace with the live workers' measured profile, side by side."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import ray

from halfmoon.cluster.bench.options import add_slo_options, bench_parser
from halfmoon.cluster.bench.workload import TRACE_BLOCK_TOKENS, prompt_tokens, scale_records
from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError
from halfmoon.cluster.config import load_config, router_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.router.cost_model import CostModel
from halfmoon.router.sim.step_simulation import make_simulation
from halfmoon.router.sim.summary import percentile
from halfmoon.router.sim.trace import TraceRecord, read_trace


@dataclass(slots=True)
class Figures:
    """The simulator's headline figures, for a live or a simulated run."""

    requests: int
    rejected: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_mean_s: float
    tbt_p99_s: float
    slo_attainment: float
    hit_rate: float
    throughput_rps: float


async def replay_live(
    address: str, records, block_tokens: int, vocab_size: int, slo: tuple[float, float]
) -> Figures:
    """Send every record at its arrival time; TTFT and TBT as the client sees them."""
    served: list[tuple[float, float]] = []  # (TTFT, TBT or -1 for a single token)
    rejected, cached, prompt, last = 0, 0, 0, 0.0
    started = time.monotonic()

    async def one(client: AsyncClient, record: TraceRecord) -> None:
        nonlocal rejected, cached, prompt, last
        await asyncio.sleep(max(0.0, record.arrival_s - (time.monotonic() - started)))
        sent = time.monotonic()
        stamps = []
        try:
            async with client.generate(
                prompt_tokens(record, block_tokens, range(6, vocab_size)),
                max_tokens=record.num_output_tokens, ignore_eos=True, temperature=0.0,
            ) as stream:  # fmt: skip
                async for delta in stream:
                    stamps.append(time.monotonic())
                    if delta.usage is not None:
                        cached += delta.usage.cached_tokens
                        prompt += delta.usage.prompt_tokens
        except ServerError as error:
            if error.code != "RESOURCE_EXHAUSTED":
                raise
            rejected += 1
            return
        tbt = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else -1.0
        served.append((stamps[0] - sent, tbt))
        last = max(last, stamps[-1] - started)

    async with AsyncClient(address) as client:
        await asyncio.gather(*(one(client, r) for r in records))
    ttft_slo, tbt_slo = slo
    met = sum(1 for ttft, tbt in served if ttft <= ttft_slo and tbt <= tbt_slo)
    ttfts = sorted(ttft for ttft, _ in served) or [0.0]
    tbts = sorted(tbt for _, tbt in served if tbt >= 0) or [0.0]
    return Figures(
        len(records), rejected, statistics.fmean(ttfts), percentile(ttfts, 0.5),
        percentile(ttfts, 0.9), percentile(ttfts, 0.99), statistics.fmean(tbts),
        percentile(tbts, 0.99), met / max(len(records), 1), cached / max(prompt, 1),
        len(served) / max(last - records[0].arrival_s, 1e-9),
    )  # fmt: skip


def simulate(cluster: Cluster, profile, records, block_tokens: int, router_profile=None) -> Figures:
    """The replayed records on simulated instances timed by `profile`, the Conductor starting
    from `router_profile` (default: the same) and refitting online, as the live one does."""
    config = cluster.config
    pools = cluster.pools
    router = router_config(config, block_tokens)
    cache_blocks = cluster.info.num_pages
    engine = config.engine
    sim = make_simulation(
        router, profile, pools["prefill"].replicas, pools["decode"].replicas, cache_blocks,
        engine.max_num_batched_tokens, engine.max_num_seqs, router_profile,
    )  # fmt: skip
    summary = sim.run(records, progress=False)
    return Figures(
        summary.requests, summary.rejected, summary.ttft_mean_s, summary.ttft_p50_s,
        summary.ttft_p90_s, summary.ttft_p99_s, summary.tbt_mean_s, summary.tbt_p99_s,
        summary.slo_attainment, summary.hit_rate, summary.throughput_rps,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        "replay",
        description="Replay the first N requests of a Mooncake trace on a live local cluster "
        "(hash ids -> seeded token blocks, lengths and times scaled) and simulate the same "
        "scaled trace step by step with the live workers' profile as observed during the "
        "replay (engine steps, hand-off time), and with the start-up profile alone; prints "
        "the simulator's figures for all three side by side.",
    )
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--requests", type=int, default=120, help="first N requests (120)")
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="tokens per trace block after scaling (16; the trace has 512)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="arrival speed-up: live time = trace time / X (1.0)",
    )
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (1)")
    parser.add_argument("--policy", default="conductor", help="routing policy (conductor)")
    parser.add_argument(
        "--admission",
        default="none",
        choices=("none", "early_rejection", "prediction_early_rejection"),
        help="SLO admission of the live router and the simulated one (none)",
    )
    add_slo_options(parser, "TTFT SLO in seconds (none)", "TBT SLO in seconds (none)")
    args = parser.parse_args(argv)
    raw, _ = read_trace(args.trace)
    records = scale_records(raw[: args.requests], args.block_tokens, args.time_scale)
    config = load_config(None, {
        "server.grpc_port": 0, "server.metrics_port": 0, "server.http_port": "off",
        "prefill.replicas": args.prefill,
        "decode.replicas": args.decode, "router.policy": args.policy,
        "router.admission": args.admission, "slo.ttft_s": args.ttft_slo,
        "slo.tbt_s": args.tbt_slo,
        "engine.block_size": args.block_tokens, "engine.prefill_chunk_size": 4 * args.block_tokens,
        "engine.num_pages": 1024, "store.use_local_redis": False,
    })  # fmt: skip
    cluster = Cluster(config)
    try:
        ports = cluster.start()
        startup = ray.get(cluster.router.profile.remote())  # measured and calibrated, not refit
        live = asyncio.run(
            replay_live(
                f"127.0.0.1:{ports['grpc_port']}",
                records,
                args.block_tokens,
                cluster.info.vocab_size,
                (args.ttft_slo or math.inf, args.tbt_slo or math.inf),
            )
        )
        steps = ray.get(cluster.router.observed_steps.remote())
        refitted = ray.get(cluster.router.profile.remote())
        observed = dataclasses.replace(
            startup,
            cost=CostModel.fit_steps(steps, startup.cost.chunk_tokens, startup.cost),
            handoff_s=refitted.handoff_s,
        )
        simulated = simulate(cluster, observed, records, args.block_tokens, startup)
        at_start = simulate(cluster, startup, records, args.block_tokens)
    finally:
        cluster.stop()  # shuts Ray down too when it started it; a caller's Ray stays up
    scale = {
        "trace": args.trace,
        "requests": len(records),
        "block_tokens": args.block_tokens,
        "token_scale": args.block_tokens / TRACE_BLOCK_TOKENS,
        "time_scale": args.time_scale,
        "prefill": args.prefill,
        "decode": args.decode,
        "policy": args.policy,
    }
    ratio = simulated.ttft_mean_s / live.ttft_mean_s if live.ttft_mean_s else float("nan")
    result = {
        "scale": scale,
        "live": asdict(live),
        "simulated": asdict(simulated),
        "simulated_startup_profile": asdict(at_start),
        "sim_over_live_ttft_mean": ratio,
        "profiles": {
            "request_overhead_s": startup.request_overhead_s,
            "handoff_s": observed.handoff_s,
            "startup": startup.cost.to_dict(),
            "observed_live": observed.cost.to_dict(),
            "steps_observed": len(steps),
        },
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"scale: {json.dumps(scale)}")
    print(
        f"{'':>10} {'ttft_mean':>10} {'p50':>8} {'p90':>8} {'p99':>8} {'tbt_mean':>9} "
        f"{'tbt_p99':>8} {'slo_met':>8} {'hit_rate':>8} {'rejected':>8} {'req/s':>6}"
    )
    for name, f in (("live", live), ("sim", simulated), ("sim@start", at_start)):
        print(
            f"{name:>10} {f.ttft_mean_s:>10.4f} {f.ttft_p50_s:>8.4f} {f.ttft_p90_s:>8.4f} "
            f"{f.ttft_p99_s:>8.4f} {f.tbt_mean_s:>9.5f} {f.tbt_p99_s:>8.4f} "
            f"{f.slo_attainment:>8.3f} {f.hit_rate:>8.3f} {f.rejected:>8} {f.throughput_rps:>6.2f}"
        )
    print(
        f"sim: instances timed by the profile fitted to the {len(steps)} live engine steps, "
        "the Conductor starting from the start-up profile; sim@start: start-up profile only; "
        f"calibrated per-request overhead {startup.request_overhead_s * 1e3:.1f} ms, "
        f"observed hand-off {observed.handoff_s * 1e3:.1f} ms"
    )
    print(f"simulated / live mean TTFT = {ratio:.3f} (goal within 0.75-1.25)", file=sys.stderr)
    return 0
