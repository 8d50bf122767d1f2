"""A stalled event loop is logged with the stack that holds it (engine/loop_watchdog.py)."""

from __future__ import annotations

import asyncio
import logging
import time

from halfmoon.engine.loop_watchdog import watch_loop


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what an endless loop or a blocking call does to every other call


def test_a_stalled_loop_is_logged_with_where_it_stands_and_when_it_runs_again(caplog):
    async def main():
        dog = watch_loop("router", stall_s=0.4)
        await asyncio.sleep(0.8)
        healthy = dog.num_stalls
        _hold_the_loop(1.2)
        await asyncio.sleep(0.8)
        dog.stop()
        return healthy, dog.num_stalls

    with caplog.at_level(logging.WARNING, logger="halfmoon.engine.loop_watchdog"):
        healthy, stalled = asyncio.run(main())
    assert (healthy, stalled) == (0, 1)  # one stall, told once
    messages = [record.getMessage() for record in caplog.records]
    assert "router: its event loop has not run for" in messages[0]
    assert "_hold_the_loop" in messages[0]  # the stack names what holds the loop
    assert messages[1:] == ["router: its event loop runs again"]
