"""`halfmoon bench router`: routing decisions per second on a large simulated cluster."""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

from halfmoon.bench.options import bench_parser
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.router.conductor import Conductor
from halfmoon.router.config import POLICY_NAMES, RouterConfig
from halfmoon.router.events import Finished, PrefillDone
from halfmoon.router.profile import DEFAULT_PROFILE, load_profile
from halfmoon.router.reports import BlockEvents
from halfmoon.router.request import RouteRequest
from halfmoon.router.sim.summary import percentile


def build_conductor(args: argparse.Namespace) -> tuple[Conductor, list[list[int]]]:
    """A Conductor over `--instances` instances whose index holds `--blocks` blocks."""
    rng = random.Random(args.seed)
    config = RouterConfig(policy=args.policy, block_size=args.block_size)
    conductor = Conductor(config, load_profile(DEFAULT_PROFILE))
    num_prefill = max(args.instances // 2, 1)
    prefill = [f"p{i}" for i in range(num_prefill)]
    for name in prefill:
        conductor.add_instance(name, "prefill")
    for i in range(max(args.instances - num_prefill, 1)):
        conductor.add_instance(f"d{i}", "decode")
    chains: list[list[int]] = []
    next_key = 0
    while next_key < args.blocks:
        chain = list(range(next_key, next_key + args.blocks_per_prompt))
        next_key += args.blocks_per_prompt
        chains.append(chain)
        owner, *replicas = rng.sample(prefill, k=rng.randint(1, 3))
        events = [BlockEvent("stored", owner, "host", chain)]
        for holder in replicas:
            events.append(
                BlockEvent("stored", holder, "device", chain[: rng.randint(1, len(chain))])
            )
        conductor.observe(BlockEvents(events))
    return conductor, chains


def run(args: argparse.Namespace) -> dict:
    """Time `--decisions` route() calls; each request shares a prefix with an indexed chain."""
    conductor, chains = build_conductor(args)
    rng = random.Random(args.seed + 1)
    latencies: list[float] = []
    fresh = 10**12
    for i in range(args.decisions + args.warmup):
        chain = rng.choice(chains)
        shared = rng.randint(0, len(chain))
        keys = chain[:shared] + list(range(fresh, fresh + len(chain) - shared))
        fresh += len(chain)
        rid = str(i)
        prompt = len(keys) * args.block_size
        request = RouteRequest(rid, keys, prompt, 256, float(i))
        start = time.perf_counter()
        decision = conductor.route(request, float(i))
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            latencies.append(elapsed)
        # Complete the request at once so the queues stay at a steady size.
        conductor.on_event(PrefillDone(rid, float(i)))
        conductor.on_event(Finished(rid, float(i), 256))
        del decision
    latencies.sort()
    total = sum(latencies)
    return {
        "policy": args.policy,
        "instances": args.instances,
        "indexed_blocks": conductor.view().num_indexed_blocks,
        "blocks_per_prompt": args.blocks_per_prompt,
        "decisions": len(latencies),
        "decisions_per_s": len(latencies) / total,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "device": f"CPU ({platform.processor() or platform.machine()}), one thread",
    }


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags; the defaults are the issue's setting."""
    parser = bench_parser("router", __doc__)
    parser.add_argument("--policy", default="conductor", choices=POLICY_NAMES)
    parser.add_argument("--instances", type=int, default=64, help="prefill + decode instances")
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks in the index")
    parser.add_argument("--blocks-per-prompt", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `halfmoon bench router`."""
    args = build_parser().parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['policy']}: {result['decisions_per_s']:,.0f} decisions/s, "
            f"p50 {result['p50_us']:.0f} us, p99 {result['p99_us']:.0f} us "
            f"({result['instances']} instances, {result['indexed_blocks']:,} indexed blocks, "
            f"{result['blocks_per_prompt']} blocks per prompt; {result['device']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
