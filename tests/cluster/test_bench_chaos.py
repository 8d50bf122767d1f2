"""`halfmoon bench chaos`: issues 35's and 49's chaos goals, small: every request completes with
its undisturbed output while a prefill worker, a decode worker, a store node, Redis and the
router are SIGKILLed in turn, each kill hitting requests in flight, and each replaced; nothing
is held after."""

from __future__ import annotations

import pytest

from halfmoon.bench.chaos import run as chaos
from halfmoon.bench.chaos.killer import KINDS
from halfmoon.bench.chaos.report import CUT_WITHIN_S

pytestmark = pytest.mark.usefixtures("ray_session")
NUM_REQUESTS = 100
# The router last: its death cuts every stream, and a kill then would find none in flight.
ORDER = ("redis", "prefill", "decode", "store", "router")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_request_completes_as_undisturbed_while_every_kind_of_part_is_killed(
    tiny_model_dir, monkeypatch
):
    monkeypatch.setenv("HALFMOON_CACHE", str(tiny_model_dir.parent))  # the default tiny model
    argv = (
        f"--num-requests {NUM_REQUESTS} --kill-every-s 1.5 --max-tokens 128 --concurrency 4 "
        f"--kill {','.join(ORDER)}"
    )
    args = chaos.build_parser().parse_args(argv.split())
    report = chaos.run_chaos(args)
    chaos.print_report(report, args)  # shown with -s, or when an assertion fails
    assert [o.error for o in report.chaos] == [None] * NUM_REQUESTS
    assert report.num_equal() == NUM_REQUESTS
    assert [k.kind for k in report.kills[: len(ORDER)]] == list(ORDER)
    assert report.kinds_hit() == set(KINDS)  # every kind of kill hit requests in flight
    assert report.restarts["router"] >= 1 and report.restarts["store"] >= 1
    assert report.restarts["redis"] >= 1
    assert max(report.cut_delays_s()) <= CUT_WITHIN_S  # the router's death cut some, fast
    assert report.held_after == {}
    assert report.passed()
