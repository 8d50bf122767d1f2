"""What each engine step computed and how long it took, and the engine's running counts."""

from __future__ import annotations

import time
from collections import deque

from halfmoon.engine.outputs import StepTiming
from halfmoon.engine.scheduler import ScheduledSeq

STEP_LOG = 512  # recent steps kept for the router's cost model
BatchShape = tuple[tuple[tuple[int, int], ...], int, int]  # StepTiming's first three fields


class StepMeter:
    """The step log the router's cost model fits to, and the counts `EngineStats` reports."""

    def __init__(self) -> None:
        self.log: deque[StepTiming] = deque(maxlen=STEP_LOG)
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self._busy_since: float | None = None  # end of the last step if it left work pending

    def start(self, batch: list[ScheduledSeq]) -> BatchShape:
        """Count a step of `batch`, before it runs: its prefill chunks as (new tokens, tokens
        before them), its decode sequences and the KV tokens they read."""
        self.num_steps += 1
        chunks, decode_seqs, decode_kv = [], 0, 0
        for item in batch:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens
                )
                chunks.append((item.num_new_tokens, seq.num_computed_tokens))
            else:
                decode_seqs += 1
                decode_kv += seq.num_computed_tokens + 1
        return tuple(chunks), decode_seqs, decode_kv

    def end(self, shape: BatchShape, started: float, busy: bool) -> None:
        """The step `start` counted, begun at `started` (perf_counter), has ended; `busy`: it
        left work pending (the next step's wait counts from now)."""
        ended = time.perf_counter()
        waited_s = started - self._busy_since if self._busy_since is not None else 0.0
        self.log.append(StepTiming(*shape, ended - started, started, waited_s))
        self._busy_since = ended if busy else None

    def idle(self) -> None:
        """A step found nothing to run: the next one follows an idle engine, not a wait."""
        self._busy_since = None

    def reset(self) -> None:
        """Counts and step log back to zero (the warm-up's steps are not traffic)."""
        self.log.clear()
        self.num_steps = self.num_prompt_tokens_computed = self.num_generated_tokens = 0
