"""A stalled event loop, told in the log with the stack that holds it.

Every call to an actor (the router, a worker) runs on its asyncio loop: one callback that does
not yield (an endless loop, a blocking call) stops them all without an error anywhere, and the
requests in flight hang. `watch_loop` starts a heartbeat task on the running loop and a daemon
thread that, once the heartbeat is `stall_s` late, logs where the loop's thread is (once a
stall) and, when the loop beats again, how long it stood still. A stall inside C code that
keeps the GIL cannot be seen from another thread; a Python one always is.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

STALL_S = 5.0  # far above any step or call the loop runs itself
BEAT_S = 0.05  # a beat this often: the longest gap between two tells any stall over it
STALL_LOG = "%s: its event loop has not run for %.1f s; its thread is at:\n%s"


class LoopWatchdog:
    """The heartbeat of one event loop and the thread that watches it (`watch_loop`)."""

    def __init__(self, name: str, stall_s: float) -> None:
        self.name = name
        self.stall_s = stall_s
        self.num_stalls = 0
        self.last_beat = time.monotonic()
        self.max_gap_s = 0.0  # the longest time between two beats since `take_max_gap_s`
        self._stopped = threading.Event()
        self._task: asyncio.Task | None = None

    def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()

    def take_max_gap_s(self) -> float:
        """The longest the loop went between two beats (`BEAT_S` apart when it runs freely)
        since the last call, and start over: a stall of S seconds shows as about S + `BEAT_S`."""
        gap, self.max_gap_s = self.max_gap_s, 0.0
        return gap

    async def _beat(self) -> None:
        while not self._stopped.is_set():
            now = time.monotonic()
            self.max_gap_s = max(self.max_gap_s, now - self.last_beat)
            self.last_beat = now
            await asyncio.sleep(BEAT_S)

    def _watch(self, loop_thread: int) -> None:
        stalled = False
        while not self._stopped.wait(min(1.0, self.stall_s / 4)):
            late = time.monotonic() - self.last_beat
            if late >= self.stall_s and not stalled:
                stalled = True
                self._stalled(loop_thread, late)
            elif late < self.stall_s and stalled:
                stalled = False
                log.warning("%s: its event loop runs again", self.name)

    def _stalled(self, loop_thread: int, late: float) -> None:
        """Count a stall and log where the loop's thread is."""
        self.num_stalls += 1
        frame = sys._current_frames().get(loop_thread)
        where = "".join(traceback.format_stack(frame)) if frame else "(thread gone)\n"
        log.warning(STALL_LOG, self.name, late, where.rstrip())


def watch_loop(name: str, stall_s: float = STALL_S) -> LoopWatchdog:
    """Watch the running event loop (call from a coroutine on it); `name` heads its logs."""
    dog = LoopWatchdog(name, stall_s)
    dog._task = asyncio.get_running_loop().create_task(dog._beat())
    threading.Thread(
        target=dog._watch, args=(threading.get_ident(),), name=f"watchdog: {name}", daemon=True
    ).start()
    return dog
