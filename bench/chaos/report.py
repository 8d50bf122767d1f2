"""What `halfmoon bench chaos` found: each request's outcome in both runs, the kills and what
each hit in flight, the replacements, how fast the router's death cut its streams, what was
still held after, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.bench.chaos.killer import KINDS, Kill
from halfmoon.kvstore.config import StoreConfig

CUT_WITHIN_S = 15.0  # an attempt the router's death cut (or a store's failed) ends within this
# And nothing is held for any request this long after the run: the longest a store lease
# outlives a holder that was killed (an arena claim whose release the killed decode worker
# owed lasts its pending TTL, 60 s; a read's lease its 30 s), and a margin.
HELD_AFTER_S = max(StoreConfig().pending_ttl_s, StoreConfig().lease_ttl_s) + 5.0


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """An attempt that failed with UNAVAILABLE and was sent again: when (monotonic seconds),
    after how long, and whether no router answered (`unreachable`: it died mid-request, or
    was not up yet) rather than the router giving up (e.g. on a dead store node)."""

    at: float
    lasted_s: float
    unreachable: bool


@dataclass(slots=True)
class Outcome:
    """One request's result: its output token ids, or the error that ended it; its attempts
    that failed with UNAVAILABLE and were sent again; and, once read from the router's
    timeline, how often the router retried and migrated it (None: not read)."""

    request_id: str
    token_ids: list[int] | None = None
    error: str | None = None
    failed: list[FailedAttempt] = field(default_factory=list)
    retries: int | None = None
    migrations: int | None = None


@dataclass(slots=True)
class ChaosReport:
    """Both runs' outcomes, the kills (`started_s`: when the first could be, monotonic), the
    replacements by kind, and what was held after the run and for how long it was waited."""

    undisturbed: list[Outcome]
    chaos: list[Outcome]
    kills: list[Kill]
    restarts: dict[str, int]
    undisturbed_s: float
    chaos_s: float
    started_s: float = 0.0
    kinds: tuple[str, ...] = KINDS
    held_after: dict[str, int] = field(default_factory=dict)
    released_s: float = 0.0

    def num_equal(self) -> int:
        pairs = zip(self.undisturbed, self.chaos, strict=True)
        return sum(1 for u, c in pairs if c.token_ids is not None and c.token_ids == u.token_ids)

    def kinds_hit(self) -> set[str]:
        """The kinds of which a kill hit requests in flight."""
        return {kill.kind for kill in self.kills if kill.in_flight > 0}

    def cut_delays_s(self) -> list[float]:
        """For each attempt under way when the router died: seconds from the kill to its
        error (attempts sent while it was down fail at once and are not counted)."""
        deaths = sorted(self.started_s + k.at_s for k in self.kills if k.kind == "router")
        delays = []
        for attempt in self._failed(unreachable=True):
            before = [death for death in deaths if attempt.at - attempt.lasted_s <= death]
            if before and before[0] <= attempt.at:
                delays.append(attempt.at - before[0])
        return delays

    def refused_s(self) -> list[float]:
        """How long each attempt the router gave up with UNAVAILABLE lasted."""
        return [attempt.lasted_s for attempt in self._failed(unreachable=False)]

    def _failed(self, unreachable: bool) -> list[FailedAttempt]:
        return [a for o in self.chaos for a in o.failed if a.unreachable == unreachable]

    def passed(self) -> bool:
        total = len(self.chaos)
        return (
            self.num_equal() == total
            and not failed(self.undisturbed)
            and self.kinds_hit() == set(self.kinds)
            and max(self.cut_delays_s() + self.refused_s(), default=0.0) <= CUT_WITHIN_S
            and not self.held_after
        )


def failed(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.error is not None]


def print_report(report: ChaosReport, args) -> None:
    total = len(report.chaos)
    kills = report.kills
    print(
        f"halfmoon bench chaos: {total} requests ({args.prompt_tokens} prompt + "
        f"{args.max_tokens} output tokens, greedy, {args.concurrency} at a time), "
        f"{args.prefill} prefill + {args.decode} decode workers, a kill due every "
        f"{args.kill_every_s:g} s, kinds in turn: {', '.join(report.kinds)}"
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
    for kind in report.kinds:
        of_kind = [k for k in kills if k.kind == kind]
        hits = ", ".join(str(k.in_flight) for k in of_kind) or "-"
        whole = ", ".join(
            f"{k.restored_s:.1f}" if k.restored_s is not None else "-" for k in of_kind
        )
        print(
            f"  {kind:<8} kills {len(of_kind)}, replaced {report.restarts.get(kind, 0)}; "
            f"requests in flight at each: {hits}; whole again after (s): {whole or '-'}"
        )
    print(f"  kill times (s): {', '.join(f'{k.at_s:.1f} {k.kind}' for k in kills) or '-'}")
    held = [f"{k.target} {k.held_s:.1f}" for k in kills if k.held_s > 0]
    if held:
        print(f"  held for the last replacement of its kind (s): {', '.join(held)}")
    delays, refused = report.cut_delays_s(), report.refused_s()
    if delays:
        print(
            f"  attempts under way when the router died: {len(delays)}, each cut within "
            f"{max(delays):.2f} s of the kill (UNAVAILABLE) and sent again"
        )
    if refused:
        print(
            f"  attempts the router gave up with UNAVAILABLE (a part died under all its "
            f"retries): {len(refused)}, each within {max(refused):.2f} s, sent again"
        )
    read = [o for o in report.chaos if o.retries is not None]
    print(
        f"  router: {sum(o.retries for o in read)} retries, "
        f"{sum(o.migrations for o in read)} migrations (timelines of {len(read)}/{total} "
        "requests: a replaced router keeps none of the dead one's)"
    )
    left = ", ".join(f"{part} {count}" for part, count in report.held_after.items())
    print(f"  held after the run: {left or 'nothing'} (waited {report.released_s:.1f} s)")
    for o in failed(report.chaos)[:10]:
        print(
            f"  failed {o.request_id} ({o.retries} retries, {o.migrations} migrations): {o.error}"
        )
    print(f"verdict: {verdict(report)}")


def verdict(report: ChaosReport) -> str:
    total, equal = len(report.chaos), report.num_equal()
    if failed(report.undisturbed):
        return f"FAIL: {len(failed(report.undisturbed))} undisturbed requests failed"
    if not report.kills:
        return "FAIL: the run ended before the first kill; raise --num-requests"
    goal = f"{total - len(failed(report.chaos))}/{total} complete, {equal}/{total} outputs equal"
    missed = sorted(set(report.kinds) - report.kinds_hit())
    if missed:
        goal += f"; no kill of {', '.join(missed)} hit work in flight (raise --num-requests)"
    if report.held_after:
        goal += f"; still held {HELD_AFTER_S:g} s after: {report.held_after}"
    state = "PASS" if report.passed() else "FAIL"
    kills = f"{len(report.kills)} kill{'s' if len(report.kills) > 1 else ''}"
    return f"{state}: {goal} to the undisturbed run, under {kills}"


def _done(outcomes: list[Outcome]) -> str:
    return f"{len(outcomes) - len(failed(outcomes))}/{len(outcomes)}"
