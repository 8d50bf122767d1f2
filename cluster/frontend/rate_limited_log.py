"""A logging filter that lets a flood of one message through once per interval, with a count.

A flood of hostile connections repeats the same few lines: asyncio logs a traceback for every
failed accept() when descriptors run out (up to `backlog` per loop tick), uvicorn a warning per
malformed request. Each is still logged, at most once per interval, saying how many it stands for.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable


class RateLimitedLog(logging.Filter):
    """Passes a record whose message (its first line) is one of `messages` at most once per
    `interval_s`, noting how many were dropped before it; any other record passes untouched."""

    def __init__(
        self,
        messages: Iterable[str],
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.messages = frozenset(messages)
        self.interval_s = interval_s
        self.clock = clock
        self.last_s: dict[str, float] = {}
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg).partition("\n")[0]
        if key not in self.messages:
            return True
        now = self.clock()
        if now < self.last_s.get(key, -math.inf) + self.interval_s:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self.last_s[key] = now
        if dropped := self.dropped.pop(key, 0):
            record.msg = f"{record.msg} [and {dropped} more like it since the last one logged]"
        return True


def install(log_filter: logging.Filter, logger_names: Iterable[str]) -> None:
    """Add `log_filter` to each named logger once (installing it again changes nothing)."""
    for name in logger_names:
        logger = logging.getLogger(name)
        if log_filter not in logger.filters:
            logger.addFilter(log_filter)
