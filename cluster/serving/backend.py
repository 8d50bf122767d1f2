"""What the frontends serve from: the cluster (router actor) or a single local engine.

The gRPC servicer and the OpenAI HTTP API only talk to a `Backend`; errors raised here are
mapped to gRPC status codes in `cluster/frontend/grpc_errors.py` and to HTTP statuses in
`cluster/frontend/http_errors.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from halfmoon.engine.errors import HalfmoonError
from halfmoon.engine.llm_engine import RequestOutput
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import TokenLogprobs
from halfmoon.engine.tokenizer import Prompt


class RejectedError(HalfmoonError):
    """Rejected for load (predicted TTFT/TBT would break the SLO): RESOURCE_EXHAUSTED."""


class NoWorkerError(HalfmoonError):
    """No worker can take the request now (none alive, or none with room): UNAVAILABLE."""


class UnauthenticatedError(HalfmoonError):
    """The API key is missing or wrong: UNAUTHENTICATED (HTTP 401)."""


class ModelNotFoundError(HalfmoonError):
    """The request names a model this server does not serve: NOT_FOUND (HTTP 404)."""


class WorkerDiedError(NoWorkerError):
    """A worker died while serving the request, after some of it was streamed: UNAVAILABLE."""


class DuplicateRequestError(HalfmoonError):
    """A request with this id is already in flight: ALREADY_EXISTS (the first one goes on)."""


@dataclass(slots=True)
class GenerateInput:
    """One request as the frontend hands it to the backend."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    # No client limit on output (OpenAI without max_tokens): generate up to the context length,
    # i.e. `params.max_tokens` becomes what the context leaves after the prompt.
    to_context_end: bool = False


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class TokenDelta:
    """Tokens and text one step added to one of the request's sequences (`index`, the
    choice); each sequence's last delta has `finish_reason`, the request's last `usage`."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0
    num_prompt_tokens: int = 0  # the client's prompt, on every delta (running usage)


@dataclass(slots=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int


class Backend(Protocol):
    """The serving side of the gRPC and OpenAI HTTP APIs."""

    def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        """Stream a request's deltas; closing the iterator early aborts the request."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a request by id; False if no such request is in flight."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def server_info(self) -> dict:
        """Mode, workers and their load, store usage: a JSON-able dict."""
        ...

    async def explain(self, request_id: str) -> str:
        """Why a recent request went where it did; `RequestNotFoundError` if not remembered."""
        ...

    async def health(self) -> tuple[bool, str]:
        """Whether a request could be served now (every pool it needs has a live worker), and
        why not."""
        ...


def delta_from_output(out: RequestOutput, usage: Usage) -> TokenDelta:
    """An engine output as the API's delta; `usage` is attached to the last one only."""
    return TokenDelta(
        token_ids=out.new_token_ids,
        text=out.new_text,
        finish_reason=out.finish_reason,
        usage=usage if out.finished else None,
        logprobs=list(out.new_logprobs),
        index=out.index,
        num_prompt_tokens=out.num_prompt_tokens,
    )
