"""What the engine returns: per-request outputs, per-step timings, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.engine.sequence import Sequence, TokenLogprobs


class StepTiming(NamedTuple):
    """One engine step: its prefill chunks as (new tokens, tokens before them), its decode
    sequences and the KV tokens they read, and its wall time (`started` is perf_counter).

    `waited_s` is how long the step started after the previous one ended while work was
    pending (lock and interpreter contention between steps); 0 after an idle engine.
    """

    prefill_chunks: tuple[tuple[int, int], ...]
    decode_seqs: int
    decode_kv_tokens: int
    seconds: float
    started: float
    waited_s: float = 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one sequence (`index`) of a request. `finish_reason` is set on
    each sequence's last output, and `finished` on the request's last (all its `n` sequences
    are done): with n=1 they come together."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # (stage, wall clock) pairs for the router's per-request trace: the engine step that made
    # this output (`AsyncEngine`), and on a stream's first output the worker's own stages.
    timeline: tuple[tuple[str, float], ...] = ()
    index: int = 0  # which of the request's `n` sequences

    @classmethod
    def of(
        cls,
        seq: Sequence,
        finished: bool,
        reason: str | None,
        token_ids: list[int] | None = None,
        text: str = "",
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """What a step added to `seq` (nothing, when it was aborted), with its prompt counts."""
        return cls(
            request_id=seq.request_id,
            new_token_ids=token_ids or [],
            new_text=text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=logprobs or [],
            index=seq.index,
        )


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges for metrics and load reports."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens of the waiting and running sequences still to compute
    num_kv_tokens: int  # tokens in the running sequences' KV
    num_pages: int
    num_used_pages: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int
    forward_s: float  # time inside the model's forward passes, for overhead figures
