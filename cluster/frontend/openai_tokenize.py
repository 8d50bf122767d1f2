"""vLLM's /tokenize and /detokenize: the served model's tokenizer over HTTP (`vllm bench
serve` aligns its random prompts to the server's tokenizer with them)."""

from __future__ import annotations

from functools import partial

from pydantic import BaseModel, Field

from halfmoon.cluster.frontend.openai_schema import STRICT, ChatMessage, Integer
from halfmoon.cluster.frontend.request_limits import RequestLimits, check_prompt
from halfmoon.cluster.serving.prompts import PromptTokenizer, prompt_chars
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.tokenizer import tokenize_prompt


class TokenizeRequest(BaseModel):
    """A text `prompt` or chat `messages` (rendered by the chat template), not both."""

    model_config = STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True  # text only: the tokenizer's BOS and the like
    add_generation_prompt: bool = True  # messages only: the template always adds it


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[Integer]


async def tokenize(body: TokenizeRequest, prompts: PromptTokenizer, limits: RequestLimits) -> dict:
    """vLLM's answer: the token ids, their count and the model's context length."""
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt", body.prompt, "send one of prompt or messages")
    if body.messages is not None and not body.add_generation_prompt:
        raise InvalidRequestError("add_generation_prompt", False, "the chat template adds it")
    prompt = body.prompt if body.messages is None else [m.for_template() for m in body.messages]
    check_prompt(prompt, limits)
    if isinstance(prompt, str) and not body.add_special_tokens:
        encode = partial(_plain, text=prompt)
    else:
        encode = partial(tokenize_prompt, prompt=prompt, vocab_size=prompts.vocab_size)
    tokens = await prompts.run(encode, prompt_chars(prompt))
    return {"count": len(tokens), "max_model_len": prompts.max_model_len, "tokens": tokens}


async def detokenize(
    body: DetokenizeRequest, prompts: PromptTokenizer, limits: RequestLimits
) -> dict:
    """vLLM's answer: the text of `tokens`."""
    check_prompt(body.tokens, limits)
    bad = [t for t in body.tokens if not 0 <= t < prompts.vocab_size]
    if bad:
        raise InvalidRequestError("tokens", bad[:5], f"ids must be in [0, {prompts.vocab_size})")
    return {"prompt": prompts.tokenizer.decode(body.tokens)}


def _plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
