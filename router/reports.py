"""What instances report to the Conductor (`Conductor.observe`): their load, the blocks their
tiers stored or evicted, and measured timings that refine the cost model."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from halfmoon.kvstore.block_events import BlockEvent


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """A prefill worker's own count of the requests it holds and the prompt tokens it has still
    to compute, taken at `as_of` (the end of its last step)."""

    instance: Hashable
    num_requests: int
    tokens_left: int
    as_of: float


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """A decode worker's running batch and the KV tokens it holds."""

    instance: Hashable
    batch_size: int
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class BlockEvents:
    """Blocks that tiers stored or evicted, for the prefix index."""

    events: Sequence[BlockEvent]


@dataclass(frozen=True, slots=True)
class EngineStep:
    """A worker's `engine.outputs.StepTiming`, from a worker at `tensor_parallel_size` (None:
    the profile's degree)."""

    step: object
    tensor_parallel_size: int | None = None


@dataclass(frozen=True, slots=True)
class RequestOverhead:
    """A calibrated per-request overhead (idle pipeline, outside prefill and hand-off)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """A measured prefill: its compute seconds and the cached tokens it really reused."""

    num_prompt_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillStepSample:
    """A measured engine step that computed only prefill `chunks` of (new tokens, tokens before
    them)."""

    chunks: Sequence[tuple[int, int]]
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeStepSample:
    """A measured decode step of `batch_size` sequences reading `kv_tokens`."""

    batch_size: int
    kv_tokens: int
    seconds: float


Sample = EngineStep | RequestOverhead | PrefillSample | PrefillStepSample | DecodeStepSample
Report = PrefillLoad | DecodeLoad | BlockEvents | Sample
