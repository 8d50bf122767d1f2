"""`halfmoon bench prefix-load`: a prompt whose prefix another prefill worker computed, loaded
from the store of their node into this worker's pages (2 prefill + 1 decode worker; the ~50M
model on cpu, the ~0.9B shape on cuda), side by side: copied straight out of the store's shared
arena (one call to lease the slots, the default) vs each layer read as a Ray object
(`get_layer`, the path before, and still the one for blocks only in Redis). Time = the loading
prefill's first step to its first token (the load and the few tokens computed after it); median
of --repeats, paths alternating."""

from __future__ import annotations

import json
import random
import statistics
import sys

import ray

from halfmoon.bench.device import (
    bench_model,
    int_list,
    live_bench_settings,
    parse_device_args,
)
from halfmoon.bench.options import bench_parser
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.cluster.worker.errors import WorkerCallError, unwrap
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.kvstore.keys import block_keys
from halfmoon.prefill_worker.task import PrefillTask

PATHS = ("arena", "objects")
TAIL_TOKENS = 16  # computed after the loaded prefix: the prefill needs a token to sample from


def measure(cluster: Cluster, prefix_tokens: int, repeats: int, seed: int) -> dict:
    """Median load time per path (ms): the loading worker's prefill from its first step to
    its first token, for a prompt whose `prefix_tokens` are in the store."""
    producer, loader = (w.actor for w in cluster.workers.values() if w.kind == "prefill")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(seed * 1_000_003 + prefix_tokens)  # no prompt repeats another
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(repeats):
        for path in PATHS:  # alternating, so drift on the machine hits both alike
            ids = [rng.randrange(6, cluster.info.vocab_size) for _ in range(prefix_tokens)]
            ids += [rng.randrange(6, cluster.info.vocab_size) for _ in range(TAIL_TOKENS)]
            rid = f"p{prefix_tokens}-{path}-{r}"
            keys = block_keys(cluster.info.root_key, ids, cluster.info.block_size)
            unwrap(ray.get(producer.prefill.remote(PrefillTask(rid + "-store", ids, params, keys))))
            unwrap(ray.get(producer.stored.remote(rid + "-store")))
            task = PrefillTask(rid, ids, params, keys, arena_loads=path == "arena")
            result = unwrap(ray.get(loader.prefill.remote(task)))
            if result.num_loaded_tokens != prefix_tokens:
                raise RuntimeError(
                    f"loaded {result.num_loaded_tokens} of the {prefix_tokens} stored tokens"
                )
            times[path].append((result.computed_at - result.started_at) * 1e3)
    medians = {path: statistics.median(times[path]) for path in PATHS}
    return {
        "prefix_tokens": prefix_tokens,
        "median_ms": medians,
        "samples_ms": times,
        "objects_over_arena": medians["objects"] / medians["arena"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("prefix-load", __doc__)
    parser.add_argument(
        "--tokens", default="512,2048", help="stored prefix lengths, multiples of 16 (512,2048)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per path and length (5)")
    args = parse_device_args(parser, argv, on_cpu="the ~50M model in fp32")
    lengths = int_list(parser, "--tokens", args.tokens)
    if min(lengths) < 16 or any(t % 16 for t in lengths) or args.repeats < 1:
        parser.error("--tokens must be multiples of 16 (at least 16), --repeats at least 1")
    longest = max(lengths) + TAIL_TOKENS
    settings = live_bench_settings(
        bench_model(args.device, args.model),
        args.device,
        **{
            "prefill.replicas": 2,
            "engine.prefill_chunk_size": 512,
            "engine.max_num_batched_tokens": max(2048, longest),
            "store.host_capacity_bytes": 2 << 30,  # every stored prefix stays in the host tier
        },
    )
    if args.device != "cuda":  # three workers on a small machine
        settings.update({"prefill.num_cpus": 0.5, "decode.num_cpus": 0.5})
        settings["engine.num_pages"] = max(256, 4 * longest // 16)
    cluster = Cluster(load_config(None, settings))
    try:
        cluster.start()
        measure(cluster, 64, 1, args.seed + 1)  # warm up both paths
        rows = [measure(cluster, tokens, args.repeats, args.seed) for tokens in lengths]
    except (WorkerCallError, RuntimeError) as error:  # e.g. a prompt beyond the context
        print(f"halfmoon bench prefix-load: {error}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return _report(rows, args.json, args.device)


def _report(rows: list[dict], as_json: bool, device: str = "cpu") -> int:
    if as_json:
        print(json.dumps({"device": device, "rows": rows}))
        return 0
    print(f"{'prefix':>7} {'arena_ms':>9} {'objects_ms':>10} {'objects/arena':>13}")
    for row in rows:
        median = row["median_ms"]
        print(
            f"{row['prefix_tokens']:>7} {median['arena']:>9.1f} {median['objects']:>10.1f} "
            f"{row['objects_over_arena']:>13.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
