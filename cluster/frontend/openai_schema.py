"""The OpenAI request bodies halfmoon accepts, and their translation into a `GenerateInput`.

Fields of OpenAI and vLLM that halfmoon does not implement pass only where they ask for
nothing (`openai_fields`); any other unknown field is an error naming it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from halfmoon.cluster.frontend.grpc_convert import MAX_LOGPROBS, MAX_N, OPTIONAL_SAMPLING_FIELDS
from halfmoon.cluster.frontend.openai_fields import (
    CHAT_NEUTRAL,
    COMMON_NEUTRAL,
    COMPLETION_NEUTRAL,
    check_functions,
    take_extras,
)
from halfmoon.cluster.frontend.openai_structured import StructuredOutputFields
from halfmoon.cluster.frontend.openai_tools import MessageToolCall, ToolFields
from halfmoon.cluster.serving.backend import GenerateInput, ModelInfo
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.structured_output import StructuredOutput
from halfmoon.engine.tokenizer import Prompt

# SamplingParams fields a request may set directly (halfmoon and vLLM extras beside OpenAI's):
# the gRPC API's scalar ones, less those OpenAI names, shapes or bounds differently.
SHAPED_HERE = ("max_tokens", "logprobs", "n")
SAMPLING_FIELDS = tuple(f for f in OPTIONAL_SAMPLING_FIELDS if f not in SHAPED_HERE)
# Every model is strict: a JSON type is never coerced ("2" is no integer, true no number, "yes"
# no boolean); an integer is still a number.
STRICT = ConfigDict(extra="forbid", strict=True)


def _json_integer(value: Any) -> Any:
    if isinstance(value, str | bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


# A JSON number with no fractional part: 2.0 is 2 (JSON, like JSON Schema, does not tell them
# apart), 2.5 and "2" are refused.
Integer = Annotated[int, Strict(False), BeforeValidator(_json_integer)]


def _one_of(accepted: str) -> WrapValidator:
    """A union field's error says what the field accepts; pydantic's is one error per member,
    each under the member's name (`prompt.str`), the first saying only what that one wants."""

    def validate(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", accepted) from None

    return WrapValidator(validate)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


PromptField = Annotated[
    str | list[Integer] | list[str] | list[list[Integer]],
    _one_of("must be a string, a list of token ids, or a list of one of those"),
]
StopField = Annotated[str | list[str], _one_of("must be a string or a list of strings")]
ContentField = Annotated[
    str | list[TextPart],
    _one_of('must be a string or a list of text parts ({"type": "text", "text": "..."})'),
]


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts. An assistant's may hold its calls,
    a tool's names the call it answers; other fields a client echoes back from an earlier
    response (refusal, annotations) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: str = Field(min_length=1)
    content: ContentField | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class OpenAIRequest(StructuredOutputFields):
    """Fields both endpoints share, halfmoon's and vLLM's extras included (the structured-output
    ones, `response_format` and vLLM's, in `openai_structured`)."""

    model_config = STRICT
    logprobs_field: ClassVar[str] = "logprobs"  # the field that counts top tokens

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Integer | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Integer | None = None
    stop: StopField | None = None
    n: Integer = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's and halfmoon's extras (OpenAI clients send them with `extra_body`)
    repetition_penalty: float | None = None
    top_k: Integer | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Integer] | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _take_extras(cls, data: Any) -> Any:
        return cls.without_extras(data)

    @classmethod
    def without_extras(cls, data: Any) -> Any:
        """The body without the fields taken and ignored (`openai_fields`)."""
        return take_extras(data, COMMON_NEUTRAL)

    @model_validator(mode="after")
    def _supported(self) -> OpenAIRequest:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", self.n, f"must be in [1, {MAX_N}]")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options", self.stream_options.model_dump(), "only allowed with stream"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's `continuous_usage_stats`, which needs `include_usage`."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return None

    def sent_name(self, field: str) -> str:
        """This request's name for an engine field (SamplingParams', the tokenizer's)."""
        return field

    def as_sent(self, error: InvalidRequestError) -> InvalidRequestError:
        """`error` naming the field as this request sent it."""
        name = self.sent_name(error.field)
        return error if name == error.field else error.renamed(name)

    def to_input(self, request_id: str, prompt: Prompt, model: ModelInfo) -> GenerateInput:
        """The backend's request, checked against `model` (token ids within its vocabulary);
        without a token limit, generate up to the context length."""
        params = self._sampling_params(model.max_model_len)
        params.validate(model.vocab_size)
        return GenerateInput(
            request_id=request_id,
            prompt=prompt,
            params=params,
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
            logit_bias=_token_biases(self.logit_bias or {}),
            structured_output=self.structured_output(),
            n=self.n,
            **kwargs,
        )


class CompletionRequest(OpenAIRequest):
    """`POST /v1/completions`: a text prompt or token ids; `logprobs` is a count of top tokens."""

    prompt: PromptField
    logprobs: Integer | None = None
    echo: bool = False

    @classmethod
    def without_extras(cls, data: Any) -> Any:
        return take_extras(data, COMPLETION_NEUTRAL)

    def wanted_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError(
                "echo", True, "not with logprobs: prompt log-probabilities are not computed"
            )
        return self.logprobs

    def sent_name(self, field: str) -> str:
        return "prompt" if field == "prompt_token_ids" else field

    def echo_text(self, prompt: Prompt, tokenizer) -> str:
        """What `echo` puts before the completion: the prompt, as text."""
        if not self.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        return tokenizer.decode(prompt, skip_special_tokens=True)

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


class ChatCompletionRequest(OpenAIRequest, ToolFields):
    """`POST /v1/chat/completions`: messages (and tools) through the model's chat template."""

    logprobs_field: ClassVar[str] = "top_logprobs"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = None
    logprobs: bool = False
    top_logprobs: Integer | None = None

    @classmethod
    def without_extras(cls, data: Any) -> Any:
        return check_functions(take_extras(data, CHAT_NEUTRAL))

    def wanted_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sent_name(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"  # it wins over max_tokens
        return field

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", self.top_logprobs, "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_prompt(self) -> Prompt:
        return [message.for_template() for message in self.messages]

    def renders_tools(self) -> bool:
        """Whether the template is given tools, or earlier calls and their results."""
        history = any(m.tool_calls or m.role == "tool" for m in self.messages)
        return bool(self.tools) or history

    def grammar_constraints(self) -> list[tuple[str, StructuredOutput]]:
        return super().grammar_constraints() + self.tool_grammars()

    def structured_output(self) -> StructuredOutput | None:
        """The output's one constraint: a call's, for `tool_choice` `required` or a function,
        else what the structured-output fields ask for."""
        asked, call = super().structured_output(), self.tool_constraint()
        if call is None:
            return asked
        if asked is not None:
            raise InvalidRequestError(
                "tool_choice",
                self.tool_choice if isinstance(self.tool_choice, str) else "<a function>",
                "a call's arguments are constrained by the function's parameters already; send "
                "no response_format or structured-output field with it",
            )
        return call


def _token_biases(biases: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` keys are token ids written as decimal strings."""
    for key in biases:
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequestError(
                "logit_bias", {key: biases[key]}, "keys must be token ids as decimal strings"
            )
    return {int(key): bias for key, bias in biases.items()}


def _slo(name: str, value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise InvalidRequestError(name, value, "must be a finite number of seconds > 0")
    return value
