"""`halfmoon bench chaos`: issues 35's and 49's chaos goals on a local disaggregated cluster.

The same greedy requests run twice on one cluster: undisturbed, then while a killer SIGKILLs one
part every `--kill-every-s` seconds, the kinds in turn (a prefill worker, a decode worker, a
store node, the local Redis, the router), and the controller replaces the dead. The router
retries a request whose prefill died and migrates a stream whose decode worker died; a request
the router's death cut fails at once with UNAVAILABLE and the client sends it again, as a gRPC
client with retries would. The goal: every request complete with the undisturbed output.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import ray

from halfmoon.bench.chaos.killer import KINDS, Killer
from halfmoon.bench.chaos.leaks import wait_released
from halfmoon.bench.chaos.report import (
    HELD_AFTER_S,
    ChaosReport,
    FailedAttempt,
    Outcome,
    print_report,
)
from halfmoon.bench.options import add_pool_options, bench_parser
from halfmoon.bench.probes.ttft import add_prompt_options, make_prompts
from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.engine.init_model import ensure_model

# How long a client sends again a request that failed with UNAVAILABLE (the router died or is
# starting; a store node died under all of the router's attempts).
RESEND_FOR_S = 120.0
RESEND_AFTER_S = 0.5


@dataclass(slots=True)
class Workload:
    """The requests both runs send: greedy, every one `max_tokens` long, at most `concurrency`
    in flight."""

    address: str
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int

    def run(self, tag: str) -> list[Outcome]:
        """Serve every prompt; one outcome per prompt, request ids `{tag}-{i}`."""
        return asyncio.run(self._serve_all(tag))

    async def _serve_all(self, tag: str) -> list[Outcome]:
        gate = asyncio.Semaphore(self.concurrency)
        async with AsyncClient(self.address) as client:
            one = (self._serve(client, gate, f"{tag}-{i}", p) for i, p in enumerate(self.prompts))
            return list(await asyncio.gather(*one))

    async def _serve(self, client, gate, request_id: str, prompt: list[int]) -> Outcome:
        """Serve one prompt; sent again, as a gRPC client with retries would, while it fails with
        UNAVAILABLE (for up to RESEND_FOR_S)."""
        outcome = Outcome(request_id)
        async with gate:
            began = time.monotonic()
            while True:
                sent = time.monotonic()
                try:
                    done = await client.complete(
                        prompt,
                        request_id=request_id,
                        max_tokens=self.max_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                    )
                    outcome.token_ids, outcome.error = done.token_ids, None
                    return outcome
                except ServerError as error:
                    outcome.error, now = str(error), time.monotonic()
                    if error.code != "UNAVAILABLE" or now - began > RESEND_FOR_S:
                        return outcome
                    outcome.failed.append(FailedAttempt(now, now - sent, error.unreachable))
                await asyncio.sleep(RESEND_AFTER_S)


def read_recoveries(cluster: Cluster, outcomes: list[Outcome]) -> None:
    """Each request's retries and migrations, while the router keeps it: every attempt is
    marked `routed` on its timeline, every migration `migrated after N output tokens`."""
    for outcome in outcomes:
        try:
            timeline = ray.get(cluster.router.timeline.remote(outcome.request_id))
        except ray.exceptions.RayTaskError:
            continue  # no longer kept (RECENT_FINISHED) or never arrived
        stages = [stage for stage, _ in timeline]
        outcome.migrations = sum(1 for s in stages if s.startswith("migrated after"))
        outcome.retries = max(stages.count("routed") - 1 - outcome.migrations, 0)


def cluster_settings(args) -> dict:
    """A local disaggregated cluster on free ports; requests wait for replacements instead of
    failing while a pool is empty, and none is rejected at arrival."""
    settings = {
        "model": args.model or str(ensure_model()),
        "mode": "disaggregated",
        "server.grpc_port": 0,
        "server.metrics_port": 0,
        "server.http_port": "off",
        "store.use_local_redis": "redis" in args.kill,  # a Redis to kill
        "prefill.replicas": args.prefill,
        "decode.replicas": args.decode,
        "prefill.num_cpus": 0.25,
        "decode.num_cpus": 0.25,
        "router.bypass_threshold_tokens": 0,  # every prompt goes through both pools
        "router.admission": "none",
        "router.pool_wait_s": 300.0,
        "health.interval_s": 0.5,
        "health.timeout_s": 60.0,
    }
    if args.model is None:  # the tiny model: its shipped profile, a KV pool to its size
        settings.update({"router.profile": "cpu-tiny", "engine.num_pages": 1024})
    return settings


def run_chaos(args) -> ChaosReport:
    """Start the cluster, serve the prompts undisturbed, then again under the killer."""
    cluster = Cluster(load_config(None, cluster_settings(args)))
    try:
        address = f"127.0.0.1:{cluster.start()['grpc_port']}"
        vocab_size = cluster.info.vocab_size
        prompts = make_prompts(args.num_requests, args.prompt_tokens, vocab_size, args.seed)
        Workload(address, prompts[:1], 1, 1).run("warm-up")
        workload = Workload(address, prompts, args.max_tokens, args.concurrency)
        started = time.monotonic()
        undisturbed = workload.run("undisturbed")
        undisturbed_s = time.monotonic() - started
        killer = Killer(cluster, args.kill_every_s, args.seed, args.kill)
        killer.start()
        try:
            chaos = workload.run("chaos")
        finally:
            killer.stop()
        chaos_s = time.monotonic() - killer.started_s
        if killer.error is not None:
            raise killer.error
        killer.controller.check_router()  # a last round: a part killed at the end is replaced
        killer.controller.check_health()
        read_recoveries(cluster, chaos)
        held_after, released_s = wait_released(cluster, HELD_AFTER_S)
    finally:
        cluster.stop()  # shuts Ray down too when it started it
    recovery = killer.controller.recovery
    restarts = {
        **killer.controller.restarts_by_kind,
        "store": recovery.num_store_restarts,
        "redis": recovery.num_redis_restarts,
        "router": recovery.num_router_restarts,
    }
    report = ChaosReport(undisturbed, chaos, killer.kills, restarts, undisturbed_s, chaos_s)
    report.started_s, report.kinds = killer.started_s, tuple(args.kill)
    report.held_after, report.released_s = held_after, released_s
    return report


def build_parser():
    parser = bench_parser(
        "chaos",
        "Issues 35's and 49's chaos goals: start a local disaggregated cluster, serve "
        "--num-requests greedy requests undisturbed, then serve them again while one part is "
        "SIGKILLed every --kill-every-s seconds, the --kill kinds in turn (the busiest serving "
        "worker of a pool, a store node, the local Redis, the router; a kind whose last "
        "victim's replacement is not serving yet is waited for), the controller replacing the "
        "dead. A request the router's death cuts fails with UNAVAILABLE and is sent again. "
        "Prints completed, failed and equal outputs, each kind's kills and what they hit in "
        "flight, retries, migrations and what was held after. Exit status 1 unless every "
        "request completed with its undisturbed output, a kill of every kind hit requests in "
        "flight, every cut failed within 15 s and nothing was held 65 s after (the longest a "
        "store lease outlives a holder that was killed, and a margin).",
        json=False,
    )
    parser.add_argument(
        "--model", help="checkpoint directory, served on CPU (default: the tiny model)"
    )
    parser.add_argument(
        "--num-requests", type=int, default=300, help="requests per run (%(default)s)"
    )
    parser.add_argument(
        "--kill-every-s",
        type=float,
        default=5.0,  # all five kinds within the ~35 s 300 requests take on 2 cores
        help="seconds between kills; a kill due while its kind's last victim has no serving "
        "replacement yet waits for it (%(default)s)",
    )
    parser.add_argument(
        "--kill",
        type=_kinds,
        default=KINDS,
        help=f"the kinds killed in turn, comma-separated ({','.join(KINDS)})",
    )
    # Two per pool: a kill leaves a live worker, where with one the pool is empty until its
    # replacement serves (7-20 s on the 2-core machine, longer than a kill's interval).
    add_pool_options(parser, prefill=2, decode=2)
    add_prompt_options(parser, prompt_tokens=128, max_tokens=128)
    parser.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight at once (%(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and the victims (%(default)s)"
    )
    return parser


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}; not {unknown or text!r}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    counts = (args.num_requests, args.prefill, args.decode, args.prompt_tokens, args.max_tokens)
    if min(counts + (args.concurrency,)) < 1 or args.kill_every_s <= 0:
        parser.error("counts and lengths must be at least 1, --kill-every-s above 0")
    report = run_chaos(args)
    print_report(report, args)
    return 0 if report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
