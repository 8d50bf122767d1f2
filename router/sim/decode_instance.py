"""A simulated decode instance: continuous batching whose step time comes from the cost model.

Between joins and leaves the batch is constant and KV grows by one token per sequence per
step, so runs of steps are advanced in closed form instead of one event per step.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from halfmoon.router.cost_model import CostModel

MIN_STEP_S = 1e-6  # the shortest decode step the simulator prices


@dataclass(slots=True)
class Finished:
    """A sequence that produced its last token."""

    request_id: str
    finish_s: float
    tbt_s: float


class SimDecode:
    """One decode instance's batch, clock and step counter."""

    def __init__(self, name: str, cost: CostModel) -> None:
        self.name = name
        self.cost = cost
        self.clock_s = 0.0
        self.steps = 0
        self.batch_size = 0
        self.kv_tokens = 0
        self.version = 0
        self._leaves: list[tuple[int, int, str]] = []
        self._joined: dict[str, tuple[float, int, int]] = {}
        self._seq = 0

    def _run_time(self, steps: int) -> float:
        # At least MIN_STEP_S a step: a fit of noisy samples can price a step at zero or less,
        # and time that does not advance would reschedule the same step for ever.
        a, b, c = self.cost.decode_coef
        first = a + b * self.batch_size + c * self.kv_tokens
        total = steps * first + c * self.batch_size * steps * (steps - 1) / 2
        return max(total, steps * MIN_STEP_S)

    def _steps_to_reach(self, budget_s: float, cap: int) -> int:
        # Fewest steps whose run time reaches budget_s, at least 1 and at most cap.
        a, b, c = self.cost.decode_coef
        first = max(a + b * self.batch_size + c * self.kv_tokens, MIN_STEP_S)
        growth = c * self.batch_size / 2
        if growth > 0:
            lin = first - growth
            steps = math.ceil((-lin + math.sqrt(lin * lin + 4 * growth * budget_s)) / (2 * growth))
        else:
            steps = math.ceil(budget_s / first)
        steps = min(max(steps, 1), cap)
        while steps > 1 and self._run_time(steps - 1) >= budget_s:
            steps -= 1
        while steps < cap and self._run_time(steps) < budget_s:
            steps += 1
        return steps

    def advance(self, now: float, until_finish: bool = False) -> list[Finished]:
        """Run every step that starts before `now` (with `until_finish`, stop after the first
        step in which a sequence finishes); return the sequences that finished."""
        done: list[Finished] = []
        while self.batch_size > 0 and self.clock_s < now and not (until_finish and done):
            cap = self._leaves[0][0] - self.steps
            steps = self._steps_to_reach(now - self.clock_s, cap)
            self.clock_s += self._run_time(steps)
            self.kv_tokens += self.batch_size * steps
            self.steps += steps
            self._pop_finished(done)
        if self.batch_size == 0 and self.clock_s < now and not (until_finish and done):
            self.clock_s = now
        return done

    def _pop_finished(self, done: list[Finished]) -> None:
        while self._leaves and self._leaves[0][0] <= self.steps:
            _, _, request_id = heapq.heappop(self._leaves)
            join_s, num_steps, context = self._joined.pop(request_id)
            self.batch_size -= 1
            self.kv_tokens -= context + num_steps
            done.append(Finished(request_id, self.clock_s, (self.clock_s - join_s) / num_steps))

    def step(self, seconds: float) -> list[Finished]:
        """Run one step of the batch that took `seconds` (a step that also computed prefill
        chunks, priced by `CostModel.step_time`); return the sequences that finished."""
        done: list[Finished] = []
        self.clock_s += seconds
        if self.batch_size > 0:
            self.kv_tokens += self.batch_size
            self.steps += 1
            self._pop_finished(done)
        return done

    def stall(self, seconds: float) -> None:
        """Hold the batch for `seconds` (a prefill run on this instance)."""
        self.clock_s += seconds

    def join(self, request_id: str, context_tokens: int, decode_steps: int) -> float:
        """Add a sequence at the current step boundary; returns the time it joined."""
        self._seq += 1
        heapq.heappush(self._leaves, (self.steps + decode_steps, self._seq, request_id))
        self._joined[request_id] = (self.clock_s, decode_steps, context_tokens)
        self.batch_size += 1
        self.kv_tokens += context_tokens
        self.version += 1
        return self.clock_s

    def next_finish_s(self) -> float | None:
        """When the next sequence finishes if nothing joins first."""
        if self.batch_size == 0:
            return None
        return self.clock_s + self._run_time(self._leaves[0][0] - self.steps)
