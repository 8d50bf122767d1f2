"""Size limits checked on every request before any work is done for it (tokenizing included).

The checks take plain values, so every frontend (gRPC, HTTP) applies the same limits; each
failure is an `InvalidRequestError` whose message quotes sizes, never the oversized values.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from halfmoon.engine.errors import InvalidRequestError

MiB = 1 << 20


class RequestLimits(BaseModel):
    """The `limits` section of the cluster config: the largest request the API accepts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # UTF-8 bytes and characters of a text prompt, or of all chat messages' contents together.
    max_prompt_bytes: int = Field(4 * MiB, ge=1)
    max_prompt_chars: int = Field(1 << 20, ge=1)
    max_prompt_token_ids: int = Field(1_000_000, ge=1)
    max_chat_messages: int = Field(1024, ge=1)
    max_stop_strings: int = Field(32, ge=0)
    # UTF-8 bytes of all stop strings together.
    max_stop_bytes: int = Field(4096, ge=0)
    max_stop_token_ids: int = Field(1024, ge=0)
    max_request_id_chars: int = Field(256, ge=1)
    # A structured-output constraint's grammar is built once by the frontend, in a process of
    # its own (`grammar_checks.py`): refused if it takes longer; how many build at once.
    grammar_timeout_s: float = Field(0.8, gt=0)
    grammar_builders: int = Field(2, ge=1, le=16)
    # Start the builder with the server (about 3 s of one core and 270 MB while xgrammar and
    # torch load) rather than within the first constrained request's wait.
    grammar_builder_at_start: bool = True


def check_request_id(request_id: str, limits: RequestLimits, field: str = "request_id") -> None:
    """A client's request id: at most `max_request_id_chars` printable characters (it goes into
    log lines and the X-Request-Id header, where a control character would break or forge one)."""
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidRequestError(
            field,
            _preview(request_id),
            f"is {len(request_id)} characters; at most {limits.max_request_id_chars} allowed",
        )
    if not request_id.isprintable():
        raise InvalidRequestError(
            field,
            _preview(request_id),
            "must be printable characters: no tab, newline or other control character",
        )


def check_text(text: str, limits: RequestLimits, field: str = "prompt") -> None:
    """Characters first (cheap), then UTF-8 bytes."""
    if len(text) > limits.max_prompt_chars:
        raise InvalidRequestError(
            field,
            f"<{len(text)} characters>",
            f"at most {limits.max_prompt_chars} characters allowed (limits.max_prompt_chars)",
        )
    _check_bytes(field, _utf8_len(text), limits)


def check_messages(contents: Sequence[str], limits: RequestLimits, field: str = "messages") -> None:
    """Chat messages: their number, then their contents' characters and bytes together."""
    if len(contents) > limits.max_chat_messages:
        raise InvalidRequestError(
            field,
            f"<{len(contents)} messages>",
            f"at most {limits.max_chat_messages} messages allowed (limits.max_chat_messages)",
        )
    num_chars = sum(len(content) for content in contents)
    if num_chars > limits.max_prompt_chars:
        raise InvalidRequestError(
            field,
            f"<{num_chars} characters>",
            f"at most {limits.max_prompt_chars} characters allowed (limits.max_prompt_chars)",
        )
    _check_bytes(field, sum(_utf8_len(content) for content in contents), limits)


def check_token_ids(num_ids: int, limits: RequestLimits, field: str = "token_ids") -> None:
    if num_ids > limits.max_prompt_token_ids:
        raise InvalidRequestError(
            field,
            f"<{num_ids} ids>",
            f"at most {limits.max_prompt_token_ids} token ids allowed "
            "(limits.max_prompt_token_ids)",
        )


def check_stops(stop: Sequence[str], stop_token_ids_count: int, limits: RequestLimits) -> None:
    """Stop strings (count, then total bytes) and the number of stop token ids."""
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            "stop",
            f"<{len(stop)} strings>",
            f"at most {limits.max_stop_strings} stop strings allowed (limits.max_stop_strings)",
        )
    num_bytes = sum(_utf8_len(s) for s in stop)
    if num_bytes > limits.max_stop_bytes:
        raise InvalidRequestError(
            "stop",
            f"<{num_bytes} bytes>",
            f"stop strings may hold {limits.max_stop_bytes} bytes together (limits.max_stop_bytes)",
        )
    if stop_token_ids_count > limits.max_stop_token_ids:
        raise InvalidRequestError(
            "stop_token_ids",
            f"<{stop_token_ids_count} ids>",
            f"at most {limits.max_stop_token_ids} allowed (limits.max_stop_token_ids)",
        )


def _check_bytes(field: str, num_bytes: int, limits: RequestLimits) -> None:
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidRequestError(
            field,
            f"<{num_bytes} bytes>",
            f"at most {limits.max_prompt_bytes} bytes allowed (limits.max_prompt_bytes)",
        )


def _utf8_len(text: str) -> int:
    # Proto strings arrived as valid UTF-8; a lone surrogate (from JSON) counts as 3 bytes.
    return len(text.encode("utf-8", "surrogatepass"))


def _preview(value: str, num_chars: int = 32) -> str:
    return value[:num_chars] + "..." if len(value) > num_chars else value


def check_prompt(prompt, limits: RequestLimits) -> None:
    """A prompt of any form (text, token ids, chat messages) within the limits."""
    if isinstance(prompt, str):
        check_text(prompt, limits)
    elif prompt and isinstance(prompt[0], dict):
        check_messages([str(message.get("content", "")) for message in prompt], limits)
    else:
        check_token_ids(len(prompt), limits, "prompt")
