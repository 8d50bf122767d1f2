"""A worker's own /metrics: its engine steps as they are handed to the router, and its process."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Histogram

from halfmoon.engine.llm_engine import StepTiming
from halfmoon.kvstore.metrics_endpoint import actor_registry

# 1 ms to 10 s: one engine step, from a small decode batch to a long prefill chunk.
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


class WorkerMetrics:
    """Engine step figures and process figures of one worker actor."""

    def __init__(self) -> None:
        self.registry = r = actor_registry()
        self.step_seconds = Histogram(
            "halfmoon_engine_step_seconds",
            "Wall time of one engine step",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.prefill_tokens = Counter(
            "halfmoon_engine_prefill_tokens", "Prompt tokens the engine prefilled", registry=r
        )
        self.decode_tokens = Counter(
            "halfmoon_engine_decode_tokens", "Tokens the engine decoded", registry=r
        )
        self.step_wait_seconds = Counter(
            "halfmoon_engine_step_wait_seconds",
            "Time between engine steps while work was pending (waiting for the engine's lock "
            "or the interpreter): the serving path's cost to the step loop",
            registry=r,
        )

    def observe(self, steps: Iterable[StepTiming]) -> None:
        """Count engine steps."""
        for step in steps:
            self.step_seconds.observe(step.seconds)
            self.prefill_tokens.inc(sum(new for new, _ in step.prefill_chunks))
            self.decode_tokens.inc(step.decode_seqs)
            self.step_wait_seconds.inc(step.waited_s)
