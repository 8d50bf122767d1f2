"""A request's way in: its parameters and id checked, its prompt tokenized and checked against
the model's and the engine's limits, and its first `Sequence` built (keys, random source,
grammar)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.forks import Forks
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import Sequence
from halfmoon.engine.tokenizer import Prompt, tokenize_prompt

if TYPE_CHECKING:
    from halfmoon.engine.config import EngineSettings
    from halfmoon.engine.model_config import ModelConfig


@dataclass(slots=True)
class Intake:
    """Builds the first sequence of each new request, or says why the request cannot run."""

    tokenizer: Any
    model: ModelConfig  # its vocabulary and context length
    config: EngineSettings  # its `max_num_seqs` and `block_size`
    forks: Forks
    grammars: Grammars
    live: dict[str, Sequence]  # the engine's requests: a new one's id is none of theirs
    # Why `n` > 1 cannot run (its sequences copy KV pages on write: `PagedKvCache.unmapped`).
    forks_refused: str | None = None
    _ids: Iterator[int] = field(default_factory=itertools.count, init=False)  # for unnamed ones

    def sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        block_keys: list[bytes] | None,
        num_prior_output_tokens: int = 0,
    ) -> Sequence:
        """The request's sequence; `InvalidRequestError` for parameters, an id, a prompt or an
        `n` that cannot run. `num_prior_output_tokens`: see `RequestTask`."""
        params = params or SamplingParams()
        params.validate(self.model.vocab_size)
        request_id = self._new_id(request_id)
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.model.vocab_size)
        self._check_fits(len(token_ids), params.n)
        seq = Sequence(request_id, token_ids, len(token_ids), params, time.monotonic())
        seq.block_keys = _checked_keys(block_keys, len(token_ids), self.config.block_size)
        seq.num_forks = params.n
        seq.generator = self.forks.generator(params, 0)
        seq.grammar = self.grammars.start(params.structured_output)
        seq.num_prior_output_tokens = num_prior_output_tokens
        return seq

    def _new_id(self, request_id: str | None) -> str:
        """`request_id`, unique among the live requests, or the next `req-<n>`."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.live:
            raise InvalidRequestError(
                "request_id", request_id, "must be unique among live requests"
            )
        return request_id

    def _check_fits(self, num_tokens: int, n: int) -> None:
        """A prompt of `num_tokens` asking for `n` sequences fits the context and the batch."""
        if num_tokens >= self.model.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{num_tokens} tokens>",
                f"must be shorter than the context length of {self.model.max_model_len} tokens",
            )
        if n > self.config.max_num_seqs:
            raise InvalidRequestError(
                "n", n, f"must be at most max_num_seqs = {self.config.max_num_seqs}"
            )
        if n > 1 and self.forks_refused is not None:
            allowed = "must be 1 on this engine: its sequences would copy KV pages on write"
            raise InvalidRequestError("n", n, f"{allowed}, not supported yet: {self.forks_refused}")


def _checked_keys(keys: list[bytes] | None, num_tokens: int, block_size: int) -> list[bytes]:
    """A copy of the prompt's given keys (the engine appends to it), one per full block at most."""
    if keys is not None and len(keys) > num_tokens // block_size:
        raise InvalidRequestError(
            "block_keys",
            f"<{len(keys)} keys>",
            f"must be at most one per full block of {block_size}",
        )
    return list(keys or [])
