"""A simulated engine stepped like `engine.LLMEngine`: each step every decoding sequence
advances one token and prefill chunks fill the rest of the token budget, oldest first, each
chunk ending on a multiple of the chunk size. Its step times come from the cost model.

The step-level simulation (`step_simulation.py`) uses one for every prefill and decode
instance when the profile's engine prefills in chunks, as the live workers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.router.cost_model import CostModel
from halfmoon.router.sim.decode_instance import Finished


def next_chunk(num_prompt_tokens: int, computed: int, budget: int, chunk_tokens: int | None) -> int:
    """Tokens of a prompt's next prefill chunk: what is left, within the step's token budget,
    ending on a multiple of `chunk_tokens` (when the engine chunks)."""
    size = min(num_prompt_tokens - computed, budget)
    if chunk_tokens:
        size = min(size, chunk_tokens - computed % chunk_tokens)
    return size


@dataclass(slots=True)
class StepJob:
    """A prompt being prefilled here; after its first token it may go on decoding here."""

    request_id: str
    num_prompt_tokens: int
    computed: int
    ready_s: float = 0.0
    decode_steps: int = 0


@dataclass(slots=True)
class Decoding:
    """A sequence in the decode batch: tokens still to produce, KV it reads."""

    request_id: str
    joined_s: float
    steps: int
    remaining: int
    kv_tokens: int


@dataclass(slots=True)
class StepPlan:
    """What the running step computes and when it ends."""

    end_s: float
    chunks: list[tuple[int, int]]
    jobs: list[StepJob]
    decode_seqs: int
    decode_kv_tokens: int
    seconds: float


@dataclass(slots=True)
class StepResult:
    """What a finished step produced."""

    prefilled: list[StepJob] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    plan: StepPlan | None = None


class SimEngine:
    """One instance's engine: prefilling jobs in arrival order and a decode batch."""

    def __init__(
        self, name: str, cost: CostModel, max_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.name = name
        self.cost = cost
        self.chunk_tokens = cost.chunk_tokens
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefills: list[StepJob] = []
        self.decoding: list[Decoding] = []
        self.kv_tokens = 0
        self.clock_s = 0.0
        self.step: StepPlan | None = None

    @property
    def batch_size(self) -> int:
        """Sequences decoding now."""
        return len(self.decoding)

    def add_prefill(self, job: StepJob) -> None:
        """Queue a prompt; it joins the steps from its `ready_s` on."""
        self.prefills.append(job)

    def join(self, request_id: str, context_tokens: int, decode_steps: int, now: float) -> None:
        """A sequence whose KV arrived joins the decode batch at the next step."""
        self.decoding.append(Decoding(request_id, now, decode_steps, decode_steps, context_tokens))
        self.kv_tokens += context_tokens

    def next_ready_s(self) -> float | None:
        """When the earliest waiting prefill becomes ready, if none is ready now."""
        return min((job.ready_s for job in self.prefills), default=None)

    def start_step(self, now: float) -> StepPlan | None:
        """Plan the step starting at `now`; None when nothing is ready to run."""
        budget = self.max_batched_tokens
        seqs = len(self.decoding)
        budget -= seqs
        chunks, jobs = [], []
        for job in self.prefills:
            if budget <= 0 or seqs >= self.max_num_seqs:
                break
            if job.ready_s > now:
                continue
            size = next_chunk(job.num_prompt_tokens, job.computed, budget, self.chunk_tokens)
            chunks.append((size, job.computed))
            jobs.append(job)
            budget -= size
            seqs += 1
        if not chunks and not self.decoding:
            return None
        kv = self.kv_tokens + len(self.decoding)
        seconds = self.cost.step_time(chunks, len(self.decoding), kv)
        self.step = StepPlan(now + seconds, chunks, jobs, len(self.decoding), kv, seconds)
        return self.step

    def finish_step(self) -> StepResult:
        """Apply the running step: advance chunks and decoding sequences."""
        plan, self.step = self.step, None
        self.clock_s = plan.end_s
        result = StepResult(plan=plan)
        for (size, _), job in zip(plan.chunks, plan.jobs, strict=True):
            job.computed += size
            if job.computed >= job.num_prompt_tokens:
                self.prefills.remove(job)
                result.prefilled.append(job)
        still = []
        for seq in self.decoding[: plan.decode_seqs]:
            seq.remaining -= 1
            seq.kv_tokens += 1
            self.kv_tokens += 1
            if seq.remaining <= 0:
                self.kv_tokens -= seq.kv_tokens
                tbt_s = (plan.end_s - seq.joined_s) / seq.steps
                result.finished.append(Finished(seq.request_id, plan.end_s, tbt_s))
            else:
                still.append(seq)
        self.decoding = still + self.decoding[plan.decode_seqs :]
        return result
