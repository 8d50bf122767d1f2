"""What the router saw of one request, stage by stage: `halfmoon status --explain` shows it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass(slots=True)
class RequestTrace:
    """Timestamps of one request as the router saw them (monotonic seconds)."""

    arrived_s: float
    num_prompt_tokens: int = 0
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_started_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    loaded_from: str | None = None  # the store node a loaded prefix came from (or "redis")
    num_output_tokens: int = 0
    predicted_ttft_s: float | None = None
    predicted_queue_s: float | None = None  # of it, the wait for the prefill instance
    prefill_compute_s: float | None = None  # the prefill worker's first to last step
    # When the prefill call returned to the router, and how long it took on the worker from
    # its compute's end to its return (each on one clock): the hand-off's two parts.
    prefill_returned_s: float | None = None
    worker_tail_s: float | None = None
    outcome: str = "error"
    reason: str = ""
    arrived_wall_s: float = dataclasses.field(default_factory=time.time)
    # (stage, seconds since arrival) in the order they happened: `halfmoon status --explain`.
    timeline: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    @property
    def handoff_s(self) -> float | None:
        """From the prefill's compute end to the first token out at the router (the worker's
        last layers and return, the router's relay); the queue before the prefill is not in
        it. None unless a prefill worker computed the first token."""
        if None in (self.worker_tail_s, self.prefill_returned_s, self.first_token_s):
            return None
        return self.worker_tail_s + self.first_token_s - self.prefill_returned_s

    def mark(self, stage: str, at_s: float | None = None) -> None:
        """Note that `stage` was reached now (or at monotonic time `at_s`)."""
        when = time.monotonic() if at_s is None else at_s
        self.timeline.append((stage, when - self.arrived_s))

    def mark_wall(self, stage: str, wall_s: float) -> None:
        """Note a stage a worker timed with its wall clock (time.time())."""
        if wall_s:
            self.timeline.append((stage, wall_s - self.arrived_wall_s))

    def summary(self, request_id: str) -> dict:
        """The request's placement, predicted and measured TTFT and cache use, as plain data
        (`halfmoon bench replay` compares them with the simulator's)."""
        ttft_s = None if self.first_token_s is None else self.first_token_s - self.arrived_s
        return {
            "request_id": request_id,
            "outcome": self.outcome,
            "prefill_instance": self.prefill_instance,
            "decode_instance": self.decode_instance,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_loaded_tokens": self.num_loaded_tokens,
            "loaded_from": self.loaded_from,
            "predicted_ttft_s": self.predicted_ttft_s,
            "predicted_queue_s": self.predicted_queue_s,
            "ttft_s": ttft_s,
        }

    def explain_timeline(self) -> str:
        workers = ", ".join(
            f"{kind} {name}"
            for kind, name in (("prefill", self.prefill_instance), ("decode", self.decode_instance))
            if name
        )
        lines = [f"timeline ({self.outcome}; {workers}; ms since arrival at the router):"]
        for stage, offset_s in sorted(self.timeline, key=lambda item: item[1]):
            lines.append(f"  {offset_s * 1e3:9.2f}  {stage}")
        return "\n".join(lines)
