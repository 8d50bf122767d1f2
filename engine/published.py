"""What an engine was at the end of its last step or call, for readers that must not wait for
the step in progress: a worker's load polls would otherwise hold its event loop (token
streams, KV moves) for up to a step each."""

from __future__ import annotations

import time
from collections import deque

from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.outputs import EngineStats, StepTiming
from halfmoon.engine.step_meter import STEP_LOG


class Published:
    """The engine's stats, ended steps and page events, published by the thread that holds its
    lock and read from another (a deque's append is atomic, as is its popleft)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._steps: deque[StepTiming] = deque(maxlen=STEP_LOG)
        self._page_events: deque[tuple[str, bytes]] = deque()
        self.publish(engine)

    def publish(self, engine: LLMEngine) -> None:
        """Under the engine's lock: take what the engine has to report now."""
        self._latest = (engine.stats(), time.time())
        self._steps.extend(engine.step_log)
        engine.step_log.clear()
        self._page_events.extend(engine.take_page_events())

    def stats(self) -> tuple[EngineStats, float]:
        """The stats last published, and how many seconds ago."""
        stats, taken_at = self._latest
        return stats, max(time.time() - taken_at, 0.0)

    def take_steps(self) -> list[StepTiming]:
        return _drain(self._steps)

    def take_page_events(self) -> list[tuple[str, bytes]]:
        return _drain(self._page_events)


def _drain(items: deque) -> list:
    """Everything in `items`, oldest first, while another thread may append to it (only the
    event loop's thread takes from it)."""
    taken = []
    while items:
        taken.append(items.popleft())
    return taken
