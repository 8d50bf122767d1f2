"""`halfmoon bench chaos`: issue 35's chaos goal, small: every request completes with its
undisturbed output while workers are SIGKILLed in turn and replaced."""

from __future__ import annotations

import pytest

from halfmoon.bench.chaos import run as chaos

pytestmark = pytest.mark.usefixtures("ray_session")
NUM_REQUESTS = 40


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_request_completes_as_undisturbed_while_workers_are_killed_in_turn(
    tiny_model_dir, monkeypatch
):
    monkeypatch.setenv("HALFMOON_CACHE", str(tiny_model_dir.parent))  # the default tiny model
    argv = f"--num-requests {NUM_REQUESTS} --kill-every-s 2 --max-tokens 128 --concurrency 4"
    args = chaos.build_parser().parse_args(argv.split())
    report = chaos.run_chaos(args)
    chaos.print_report(report, args)  # shown with -s, or when an assertion fails
    assert [o.error for o in report.chaos] == [None] * NUM_REQUESTS
    assert report.num_equal() == NUM_REQUESTS
    assert [k.pool for k in report.kills[:2]] == ["prefill", "decode"]
    assert report.passed()
