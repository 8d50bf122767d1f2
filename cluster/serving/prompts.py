"""Prompts to token ids for the router, off the event loop when they are long, and the
context-length checks every request passes before it is placed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from functools import partial

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.tokenizer import Prompt, tokenize_prompt

# Prompts longer than this are tokenized in a thread, so a huge one never stalls the event
# loop that serves every other request (tokenizers release the GIL as they go).
INLINE_TOKENIZE_CHARS = 2048
TOKENIZE_THREADS = 4


class PromptTokenizer:
    """Tokenizes prompts for a model with `vocab_size` tokens and `max_model_len` context."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._thread_tokenizers = threading.local()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; `InvalidRequestError` if it leaves no room to generate."""
        encode = partial(tokenize_prompt, prompt=prompt, vocab_size=self.vocab_size)
        token_ids = await self.run(encode, prompt_chars(prompt))
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{len(token_ids)} tokens>",
                f"must be shorter than the context length of {self.max_model_len} tokens",
            )
        return token_ids

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Prompt and output must fit the context: a request that cannot is refused now."""
        limit = self.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                "max_tokens",
                max_tokens,
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens must fit the "
                f"context length of {limit} tokens; ask for at most "
                f"{limit - num_prompt_tokens} tokens",
            )

    async def run(self, encode: Callable[..., list[int]], num_chars: int) -> list[int]:
        """`encode(tokenizer)`: here when the text is short (`num_chars`), else in a thread,
        so a long prompt never stalls the event loop."""
        if num_chars <= INLINE_TOKENIZE_CHARS:
            return encode(self.tokenizer)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._in_thread, encode)

    def _in_thread(self, encode: Callable[..., list[int]]) -> list[int]:
        # Each thread its own copy: a fast tokenizer shared across threads can fail with
        # "Already borrowed" when one call changes its truncation settings.
        tokenizer = getattr(self._thread_tokenizers, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._thread_tokenizers.tokenizer = deepcopy(self.tokenizer)
        return encode(tokenizer)


def prompt_chars(prompt: Prompt) -> int:
    """About how much tokenizing a prompt costs: characters of text, or list entries."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(
        len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1
        for m in prompt
    )
