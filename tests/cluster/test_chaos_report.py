"""The chaos bench's judgement without a cluster: which attempts the router's death cut and
how fast, what a kill hit, the `--kill` kinds; and the controller's patience with a silent
part (recovery.Silence)."""

from __future__ import annotations

import argparse

import pytest

from halfmoon.bench.chaos import run as chaos
from halfmoon.bench.chaos.killer import KINDS, Kill
from halfmoon.bench.chaos.report import ChaosReport, FailedAttempt, Outcome
from halfmoon.cluster.control.recovery import Silence


def _report(kills, chaos_outcomes, kinds=KINDS) -> ChaosReport:
    undisturbed = [Outcome(o.request_id, [1, 2]) for o in chaos_outcomes]
    report = ChaosReport(undisturbed, chaos_outcomes, kills, {}, 1.0, 2.0, started_s=100.0)
    report.kinds = kinds
    return report


def test_an_attempt_under_way_at_the_router_s_death_counts_from_the_kill():
    kills = [Kill("router", "router", 7, at_s=10.0, held_s=0.0, in_flight=3)]
    cut = Outcome("a", [1, 2], failed=[FailedAttempt(at=110.2, lasted_s=4.0, unreachable=True)])
    # Sent while no router was up: refused at once, not a cut stream.
    refused = Outcome(
        "b", [1, 2], failed=[FailedAttempt(at=111.0, lasted_s=0.01, unreachable=True)]
    )
    gave_up = Outcome("c", [1, 2], failed=[FailedAttempt(at=90.0, lasted_s=0.3, unreachable=False)])
    report = _report(kills, [cut, refused, gave_up], kinds=("router",))
    assert report.cut_delays_s() == pytest.approx([0.2])
    assert report.refused_s() == [0.3]
    assert report.kinds_hit() == {"router"} and report.passed()


def test_a_kind_whose_kills_hit_nothing_in_flight_fails_the_run():
    kills = [
        Kill(kind, kind, 7, at_s=i, held_s=0.0, in_flight=0 if kind == "redis" else 2)
        for i, kind in enumerate(KINDS)
    ]
    report = _report(kills, [Outcome("a", [1, 2])])
    assert report.kinds_hit() == set(KINDS) - {"redis"}
    assert not report.passed()
    report.kills[3].in_flight = 1
    assert report.passed()
    report.held_after = {"decode-1 pages": 3}  # a leak fails it too
    assert not report.passed()


def test_kill_kinds_are_parsed_and_checked():
    parser = chaos.build_parser()
    assert parser.parse_args([]).kill == KINDS
    assert parser.parse_args(["--kill", "router, store"]).kill == ("router", "store")
    with pytest.raises(argparse.ArgumentTypeError, match="kinds are"):
        chaos._kinds("router,gcs")


def test_a_silent_part_is_busy_until_the_bound_then_dead(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("halfmoon.cluster.control.recovery.time.monotonic", lambda: now[0])
    silence = Silence(bound_s=3.0)
    assert not silence.too_long("router")
    now[0] = 2.9
    assert not silence.too_long("router")
    now[0] = 3.0
    assert silence.too_long("router")
    silence.answered("router")
    assert not silence.too_long("router") and silence.since == {"router": 3.0}
