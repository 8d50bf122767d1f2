"""Proto messages to and from the backend's value types; every field that arrives is checked."""

from __future__ import annotations

import math
import uuid
from dataclasses import asdict

from halfmoon.cluster.api import halfmoon_pb2 as pb
from halfmoon.cluster.frontend.request_limits import (
    RequestLimits,
    check_messages,
    check_request_id,
    check_stops,
    check_text,
    check_token_ids,
)
from halfmoon.cluster.serving.backend import GenerateInput, ModelInfo, TokenDelta, Usage
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import TokenLogprobs
from halfmoon.engine.structured_output import StructuredOutput
from halfmoon.engine.tokenizer import Prompt

MAX_LOGPROBS = 20
MAX_N = 16  # the most sequences (`n`) one request may ask for, on either API
# Proto3 `optional` fields: only those a client set reach SamplingParams, so its defaults rule.
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "ignore_eos",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "n",
)
REPEATED_SAMPLING_FIELDS = ("stop", "stop_token_ids")
MAP_SAMPLING_FIELDS = ("logit_bias",)
MESSAGE_SAMPLING_FIELDS = ("structured_output",)  # a StructuredOutput, as the engine's
SAMPLING_FIELDS = (
    *OPTIONAL_SAMPLING_FIELDS,
    *REPEATED_SAMPLING_FIELDS,
    *MAP_SAMPLING_FIELDS,
    *MESSAGE_SAMPLING_FIELDS,
)


def input_from_proto(
    request: pb.GenerateRequest, limits: RequestLimits | None = None
) -> GenerateInput:
    """The backend's request; raises `InvalidRequestError` naming the first bad field.
    Sizes are checked against `limits` (default: the config's defaults) before anything else."""
    check_sizes(request, limits or RequestLimits())
    return GenerateInput(
        request_id=_request_id(request.request_id),
        prompt=_prompt(request),
        params=_sampling_params(request.sampling),
        ttft_slo_s=_slo(request, "ttft_slo_s"),
        tbt_slo_s=_slo(request, "tbt_slo_s"),
    )


def check_sizes(request: pb.GenerateRequest, limits: RequestLimits) -> None:
    """Every size limit of a `GenerateRequest`; raises `InvalidRequestError` on the first."""
    check_request_id(request.request_id, limits)
    kind = request.WhichOneof("input")
    if kind == "text":
        check_text(request.text, limits, "text")
    elif kind == "token_ids":
        check_token_ids(len(request.token_ids.ids), limits)
    elif kind == "chat":
        check_messages([m.content for m in request.chat.messages], limits, "chat.messages")
    check_stops(request.sampling.stop, len(request.sampling.stop_token_ids), limits)


def request_to_proto(
    request_id: str,
    prompt: Prompt,
    sampling: dict,
    ttft_slo_s: float | None = None,
    tbt_slo_s: float | None = None,
) -> pb.GenerateRequest:
    """A `GenerateRequest`; `sampling` holds SamplingParams fields, None meaning unset."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameters {sorted(unknown)}; known: {', '.join(SAMPLING_FIELDS)}"
        )
    set_fields = {name: value for name, value in sampling.items() if value is not None}
    if (structured := set_fields.get("structured_output")) is not None:
        set_fields["structured_output"] = pb.StructuredOutput(**asdict(structured))
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling=pb.SamplingParams(**set_fields),
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        request.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
    elif isinstance(prompt, list):
        request.token_ids.ids.extend(prompt)
    else:
        raise TypeError(f"prompt is a {type(prompt).__name__}; pass text, token ids or messages")
    return request


def delta_to_proto(request_id: str, delta: TokenDelta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[_logprob_to_proto(lp) for lp in delta.logprobs],
        finish_reason=delta.finish_reason,
        index=delta.index,
    )
    if delta.usage is not None:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=delta.usage.prompt_tokens,
                completion_tokens=delta.usage.completion_tokens,
                cached_tokens=delta.usage.cached_tokens,
            )
        )
    return response


def delta_from_proto(response: pb.GenerateResponse) -> TokenDelta:
    usage = response.usage if response.HasField("usage") else None
    return TokenDelta(
        token_ids=list(response.token_ids),
        text=response.text,
        finish_reason=response.finish_reason if response.HasField("finish_reason") else None,
        usage=Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if usage
        else None,
        logprobs=[
            TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            for lp in response.logprobs
        ],
        index=response.index,
    )


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
    )


def model_info_from_proto(info: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        info.model, info.architecture, info.vocab_size, info.max_model_len, info.block_size
    )


def _request_id(request_id: str) -> str:
    return request_id or uuid.uuid4().hex


def _prompt(request: pb.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("input")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("text", "", "must be a non-empty string")
        return request.text
    if kind == "token_ids":
        return _token_ids(list(request.token_ids.ids))
    if kind == "chat":
        return _messages(request.chat)
    raise InvalidRequestError("input", None, "set one of text, token_ids or chat")


def _token_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise InvalidRequestError("token_ids", "<0 ids>", "must hold at least one token id")
    negative = [t for t in ids if t < 0]
    if negative:
        raise InvalidRequestError("token_ids", negative[:5], "token ids must be >= 0")
    return ids


def _messages(chat: pb.ChatMessages) -> list[dict]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", [], "must hold at least one message")
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidRequestError(
                f"chat.messages[{i}].role", "", "must be a non-empty string such as 'user'"
            )
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def _sampling_params(proto: pb.SamplingParams) -> SamplingParams:
    kwargs = {n: getattr(proto, n) for n in OPTIONAL_SAMPLING_FIELDS if proto.HasField(n)}
    kwargs |= {n: list(v) for n in REPEATED_SAMPLING_FIELDS if (v := getattr(proto, n))}
    kwargs |= {n: dict(v) for n in MAP_SAMPLING_FIELDS if (v := getattr(proto, n))}
    if kwargs.get("logprobs", 0) > MAX_LOGPROBS:
        raise InvalidRequestError("logprobs", kwargs["logprobs"], f"must be at most {MAX_LOGPROBS}")
    if not 1 <= kwargs.get("n", 1) <= MAX_N:
        raise InvalidRequestError("n", kwargs["n"], f"must be in [1, {MAX_N}]")
    if proto.HasField("structured_output"):
        kwargs["structured_output"] = _structured_output(proto.structured_output)
    return SamplingParams(**kwargs)


STRUCTURED_FIELD = "sampling.structured_output"


def _structured_output(proto: pb.StructuredOutput) -> StructuredOutput:
    """The constraint, checked against its limits (the servicer then builds its grammar)."""
    structured = StructuredOutput(proto.kind, proto.spec)
    try:
        structured.validate()
    except InvalidRequestError as error:
        raise error.renamed(STRUCTURED_FIELD) from None
    return structured


def grammar_constraints(generate_input: GenerateInput) -> list[tuple[str, StructuredOutput]]:
    """The request's constraint whose grammar the servicer builds, under its field's name."""
    structured = generate_input.params.structured_output
    return [] if structured is None else [(STRUCTURED_FIELD, structured)]


def _slo(request: pb.GenerateRequest, name: str) -> float | None:
    if not request.HasField(name):
        return None
    value = getattr(request, name)
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(name, value, "must be a finite number of seconds > 0")
    return value


def _logprob_to_proto(logprobs: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )
