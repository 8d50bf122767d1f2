"""A request's way in: its prompt tokenized and checked against the model's and the engine's
limits, and its first `Sequence` built (keys, random source, grammar)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.forks import Forks
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import Sequence
from halfmoon.engine.tokenizer import Prompt, tokenize_prompt


@dataclass(slots=True)
class Intake:
    """Builds the sequence of a request whose parameters and id the engine has checked."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    forks: Forks
    grammars: Grammars
    # Why `n` > 1 cannot run (its sequences copy KV pages on write: `PagedKvCache.unmapped`).
    forks_refused: str | None = None

    def sequence(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        block_keys: list[bytes] | None,
    ) -> Sequence:
        """The request's sequence; `InvalidRequestError` for a prompt or `n` that cannot run."""
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{len(token_ids)} tokens>",
                f"must be shorter than the context length of {self.max_model_len} tokens",
            )
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(
                "n", params.n, f"must be at most max_num_seqs = {self.max_num_seqs}"
            )
        if params.n > 1 and self.forks_refused is not None:
            allowed = "must be 1 on this engine: its sequences would copy KV pages on write"
            raise InvalidRequestError(
                "n", params.n, f"{allowed}, not supported yet: {self.forks_refused}"
            )
        seq = Sequence(request_id, token_ids, len(token_ids), params, time.monotonic())
        seq.block_keys = _checked_keys(block_keys, len(token_ids), self.block_size)
        seq.num_forks = params.n
        seq.generator = self.forks.generator(params, 0)
        seq.grammar = self.grammars.start(params.structured_output)
        return seq


def _checked_keys(keys: list[bytes] | None, num_tokens: int, block_size: int) -> list[bytes]:
    """A copy of the prompt's given keys (the engine appends to it), one per full block at most."""
    if keys is not None and len(keys) > num_tokens // block_size:
        raise InvalidRequestError(
            "block_keys",
            f"<{len(keys)} keys>",
            f"must be at most one per full block of {block_size}",
        )
    return list(keys or [])
