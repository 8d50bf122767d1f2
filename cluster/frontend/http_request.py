"""Reading one HTTP request: its body within the size limit, its id header, its JSON body as
the endpoint's schema; every problem as an `InvalidRequestError` naming the part at fault."""

from __future__ import annotations

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from halfmoon.cluster.frontend.openai_schema import OpenAIRequest
from halfmoon.cluster.frontend.request_limits import RequestLimits, check_request_id
from halfmoon.engine.errors import InvalidRequestError

REQUEST_ID_HEADER = "X-Request-Id"


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused once it is known to exceed `max_bytes`: by its Content-Length before
    any of it is read, else (chunked) as soon as the bytes read so far exceed it."""
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > max_bytes:
        raise _body_too_large(f"<{declared} bytes>", max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _body_too_large(f"<more than {max_bytes} bytes>", max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


def _body_too_large(value: str, max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(
        "body",
        value,
        f"at most {max_bytes} bytes allowed (limits.max_prompt_bytes plus room for the other "
        "fields)",
    )


def request_id_of(request: Request, limits: RequestLimits) -> str | None:
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        return None
    if not request_id:  # a header sent empty (or blank: its spaces are stripped)
        raise InvalidRequestError(
            REQUEST_ID_HEADER, request_id, "must be printable characters, at least one"
        )
    check_request_id(request_id, limits, REQUEST_ID_HEADER)
    return request_id


def check_json(content_type: str | None) -> None:
    """The body must be declared JSON: a web page may POST a text/plain, form or untyped body to
    any server without a CORS preflight, but not an application/json one."""
    if (content_type or "").partition(";")[0].strip().lower() != "application/json":
        raise InvalidRequestError(
            "Content-Type",
            content_type,
            "must be application/json (parameters such as charset=utf-8 may follow)",
        )


def parse(schema: type[OpenAIRequest], body: bytes) -> OpenAIRequest:
    """The request body as `schema`; the first problem as an `InvalidRequestError`."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequestError):
            raise cause from None
        where = ".".join(str(part) for part in error["loc"]) or "body"
        value = error["input"] if error["type"] != "missing" else None
        message = error["msg"]
        if error["type"] == "json_invalid":
            value = "<not JSON>"
            if "hex escape" in message:  # what the JSON parser says of a lone surrogate
                message = (
                    f"{message}: a \\u escape is incomplete or a lone surrogate "
                    "(\\ud800-\\udfff), which is not Unicode; send the character itself or a "
                    "whole surrogate pair"
                )
        elif error["type"] == "extra_forbidden":
            message = "unknown field (the accepted ones are listed in docs/openai.md)"
        raise InvalidRequestError(where, value, message) from None
