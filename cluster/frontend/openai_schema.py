"""The OpenAI request bodies halfmoon accepts, and their translation into a `GenerateInput`.

Unknown fields are errors. OpenAI fields halfmoon does not implement are accepted only at
their neutral value (e.g. `presence_penalty: 0`), so a client relying on one learns it at once.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from halfmoon.cluster.frontend.grpc_convert import MAX_LOGPROBS
from halfmoon.cluster.serving.backend import GenerateInput
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.tokenizer import Prompt

# Unimplemented OpenAI fields and the values that ask for nothing.
NEUTRAL_VALUES: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "store": (False,),
}
# SamplingParams fields a request may set directly (halfmoon extras beside OpenAI's).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts. Fields a client echoes back from
    an earlier response (tool calls, refusal) are ignored."""

    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class OpenAIRequest(BaseModel):
    """Fields both endpoints share, halfmoon's extras included."""

    model_config = ConfigDict(extra="forbid")
    logprobs_field: ClassVar[str] = "logprobs"  # the field that counts top tokens

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    metadata: dict[str, str] | None = None
    # halfmoon extras (OpenAI clients send them with `extra_body`)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    # OpenAI fields halfmoon does not implement: only their neutral values pass.
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None

    @model_validator(mode="after")
    def _supported(self) -> OpenAIRequest:
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                raise InvalidRequestError(name, value, "not supported by halfmoon; leave it unset")
        if self.n != 1:
            raise InvalidRequestError(
                "n", self.n, "only n=1 is supported; send one request per choice"
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options", self.stream_options.model_dump(), "only allowed with stream"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return None

    def to_input(self, request_id: str, prompt: Prompt, max_model_len: int) -> GenerateInput:
        """The backend's request; without a token limit, generate up to the context length."""
        return GenerateInput(
            request_id=request_id,
            prompt=prompt,
            params=self._sampling_params(max_model_len),
            ttft_slo_s=_slo("ttft_slo_s", self.ttft_slo_s),
            tbt_slo_s=_slo("tbt_slo_s", self.tbt_slo_s),
            to_context_end=self.wanted_max_tokens() is None,
        )

    def _sampling_params(self, max_model_len: int) -> SamplingParams:
        kwargs = {n: v for n in SAMPLING_FIELDS if (v := getattr(self, n)) is not None}
        logprobs = self.wanted_logprobs()
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                self.logprobs_field, logprobs, f"must be in [0, {MAX_LOGPROBS}]"
            )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        max_tokens = self.wanted_max_tokens()
        return SamplingParams(
            max_tokens=max_model_len if max_tokens is None else max_tokens,
            stop=stop or [],
            stop_token_ids=self.stop_token_ids or [],
            logprobs=logprobs,
            **kwargs,
        )


class CompletionRequest(OpenAIRequest):
    """`POST /v1/completions`: a text prompt or token ids; `logprobs` is a count of top tokens."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def to_prompt(self) -> Prompt:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequestError(
                    "prompt", f"<{len(prompt)} prompts>", "send one prompt per request"
                )
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequestError("prompt", prompt, "must not be empty")
        return prompt


class ChatCompletionRequest(OpenAIRequest):
    """`POST /v1/chat/completions`: messages through the model's chat template."""

    logprobs_field: ClassVar[str] = "top_logprobs"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    store: Any = None

    def wanted_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", self.top_logprobs, "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_prompt(self) -> Prompt:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def _slo(name: str, value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise InvalidRequestError(name, value, "must be a finite number of seconds > 0")
    return value
