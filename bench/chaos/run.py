"""`halfmoon bench chaos`: issue 35's chaos goal on a local disaggregated cluster.

The same greedy requests run twice on one cluster: undisturbed, then while a killer SIGKILLs one
serving worker every `--kill-every-s` seconds, prefill and decode pools in turn, and the
controller replaces the dead. The router retries a request whose prefill died and migrates a
stream whose decode worker died; the goal is every request complete with the undisturbed output.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import ray

from halfmoon.bench.chaos.killer import POOLS, Kill, Killer
from halfmoon.bench.options import add_pool_options, bench_parser
from halfmoon.bench.probes.ttft import add_prompt_options, make_prompts
from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError
from halfmoon.cluster.config import load_config
from halfmoon.cluster.control.launcher import Cluster
from halfmoon.engine.init_model import ensure_model


@dataclass(slots=True)
class Outcome:
    """One request's result: its output token ids, or the error that ended it; and, once read
    from the router's timeline, how often it was retried and migrated (None: not read)."""

    request_id: str
    token_ids: list[int] | None = None
    error: str | None = None
    retries: int | None = None
    migrations: int | None = None


@dataclass(slots=True)
class ChaosReport:
    """Both runs' outcomes, the kills and the controller's replacements."""

    undisturbed: list[Outcome]
    chaos: list[Outcome]
    kills: list[Kill]
    num_restarts: int
    undisturbed_s: float
    chaos_s: float

    def num_equal(self) -> int:
        pairs = zip(self.undisturbed, self.chaos, strict=True)
        return sum(1 for u, c in pairs if c.token_ids is not None and c.token_ids == u.token_ids)

    def passed(self) -> bool:
        total = len(self.chaos)
        return self.num_equal() == total and not failed(self.undisturbed) and bool(self.kills)


def failed(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.error is not None]


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
        outcome = Outcome(request_id)
        async with gate:
            try:
                done = await client.complete(
                    prompt,
                    request_id=request_id,
                    max_tokens=self.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                )
                outcome.token_ids = done.token_ids
            except ServerError as error:
                outcome.error = str(error)
        return outcome


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
        "store.use_local_redis": False,
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
        killer = Killer(cluster, args.kill_every_s, args.seed)
        killer.start()
        try:
            chaos = workload.run("chaos")
        finally:
            killer.stop()
        chaos_s = time.monotonic() - killer.started_s
        if killer.error is not None:
            raise killer.error
        read_recoveries(cluster, chaos)
    finally:
        cluster.stop()  # shuts Ray down too when it started it
    return ChaosReport(
        undisturbed,
        chaos,
        killer.kills,
        killer.controller.num_restarts,
        undisturbed_s,
        chaos_s,
    )


def print_report(report: ChaosReport, args) -> None:
    total = len(report.chaos)
    kills = report.kills
    print(
        f"halfmoon bench chaos: {total} requests ({args.prompt_tokens} prompt + "
        f"{args.max_tokens} output tokens, greedy, {args.concurrency} at a time), "
        f"{args.prefill} prefill + {args.decode} decode workers, a kill due every "
        f"{args.kill_every_s:g} s"
    )
    rows = [
        ("", "undisturbed", "chaos"),
        ("requests completed", _done(report.undisturbed), _done(report.chaos)),
        ("requests failed", len(failed(report.undisturbed)), len(failed(report.chaos))),
        ("outputs equal to undisturbed", "-", f"{report.num_equal()}/{total}"),
        ("wall time", f"{report.undisturbed_s:.1f} s", f"{report.chaos_s:.1f} s"),
    ]
    for name, a, b in rows:
        print(f"  {name:<30}{a!s:>12}{b!s:>12}")
    per_pool = ", ".join(f"{pool} {sum(k.pool == pool for k in kills)}" for pool in POOLS)
    print(f"  kills: {len(kills)} ({per_pool}); workers replaced: {report.num_restarts}")
    print(f"  kill times (s): {', '.join(f'{k.at_s:.1f}' for k in kills) or '-'}")
    intervals = [b.at_s - a.at_s for a, b in zip(kills, kills[1:], strict=False)]
    print(f"  intervals (s): {', '.join(f'{i:.1f}' for i in intervals) or '-'}")
    restored = [f"{k.restored_s:.1f}" if k.restored_s is not None else "-" for k in kills]
    print(f"  pool whole again after (s): {', '.join(restored) or '-'}")
    print(f"  requests in flight on the victim: {', '.join(str(k.in_flight) for k in kills)}")
    held = [f"{k.worker} {k.held_s:.1f}" for k in kills if k.held_s > 0]
    if held:
        print(f"  held for the pool's replacement (s): {', '.join(held)}")
    read = [o for o in report.chaos if o.retries is not None]
    print(
        f"  router: {sum(o.retries for o in read)} retries, "
        f"{sum(o.migrations for o in read)} migrations (timelines of {len(read)}/{total} requests)"
    )
    for o in failed(report.chaos)[:10]:
        moves = f"{o.retries} retries, {o.migrations} migrations"
        print(f"  failed {o.request_id} ({moves}): {o.error}")
    print(f"verdict: {verdict(report)}")


def verdict(report: ChaosReport) -> str:
    total, equal = len(report.chaos), report.num_equal()
    if failed(report.undisturbed):
        return f"FAIL: {len(failed(report.undisturbed))} undisturbed requests failed"
    if not report.kills:
        return "FAIL: the run ended before the first kill; raise --num-requests"
    goal = f"{total - len(failed(report.chaos))}/{total} complete, {equal}/{total} outputs equal"
    state = "PASS" if report.passed() else "FAIL"
    kills = f"{len(report.kills)} kill{'s' if len(report.kills) > 1 else ''}"
    return f"{state}: {goal} to the undisturbed run, under {kills}"


def _done(outcomes: list[Outcome]) -> str:
    return f"{len(outcomes) - len(failed(outcomes))}/{len(outcomes)}"


def build_parser():
    parser = bench_parser(
        "chaos",
        "Issue 35's chaos goal: start a local disaggregated cluster, serve --num-requests "
        "greedy requests undisturbed, then serve them again while the busiest serving worker is "
        "SIGKILLed every --kill-every-s seconds, prefill and decode pools in turn (a pool whose "
        "last victim's replacement is not serving yet is waited for), the controller replacing "
        "the dead. Prints completed, failed and equal outputs, kills, retries and migrations. "
        "Exit status 1 unless a worker was killed and every request completed with its "
        "undisturbed output.",
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
        default=10.0,
        help="seconds between kills; a kill due while its pool's last victim has no serving "
        "replacement yet waits for it (%(default)s)",
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
