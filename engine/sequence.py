"""One request's tokens and progress through the engine."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from halfmoon.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from halfmoon.engine.grammar import GrammarState


class SequenceStatus(Enum):
    WAITING = "waiting"
    # Its pages held while its prompt's KV is written from outside (disaggregated decode),
    # until it joins the batch (vLLM's WAITING_FOR_REMOTE_KVS).
    RESERVED = "reserved"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the `top` most likely tokens at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt plus generated tokens, the pages holding their KV, and how far compute has got."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_s: float
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Pages holding the KV, in order. Only ever appended to, or replaced by a new list (the
    # decode graphs copy to the GPU only the pages added since the last step).
    block_table: list[int] = field(default_factory=list)
    # Keys of the full blocks known so far: the prompt's as given (hashed once, by the router),
    # then each block the engine completes; the first `num_cached_blocks` are in the cache.
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    text: str = ""
    num_emitted_chars: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    utf8: codecs.IncrementalDecoder | None = None  # byte-level detokenization's pending bytes
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Of the prompt, how many trailing tokens an earlier attempt generated (a migrated request
    # is prefilled again with its output so far): frequency and presence penalties count them.
    num_prior_output_tokens: int = 0
    # The request's grammar when its output is constrained (shared by its `n` sequences).
    grammar: GrammarState | None = None
    # Of the request's `params.n` sequences, which one this is; `num_forks`: how many it
    # becomes once its prompt is computed (`params.n`, then 1). Forked, all of them share one
    # `siblings` list (index order) and the prompt's pages (engine/page_pool.py).
    index: int = 0
    num_forks: int = 1
    siblings: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def group(self) -> list[Sequence]:
        """Every sequence of this one's request: its siblings once forked, else itself."""
        return self.siblings or [self]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
