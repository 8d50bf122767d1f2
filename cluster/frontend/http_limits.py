"""How long and how many the OpenAI HTTP API waits for: the `server.http_limits` section.

`http_protocol` enforces them while reading; the body's size bound is `limits.max_prompt_bytes`
plus room for the other fields (`http_server`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HttpLimits(BaseModel):
    """Read deadlines and connection bounds of the HTTP API; a client over them gets 408, 503
    or 400 and its connection is closed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A request's line and headers must arrive within this of the connection opening (or of
    # the previous response on a kept-alive one).
    header_timeout_s: float = Field(10.0, gt=0)
    # Its whole body within this of its headers (a total, not a gap between reads).
    body_timeout_s: float = Field(60.0, gt=0)
    # An idle kept-alive connection is closed after this (uvicorn's timeout_keep_alive).
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    # Open connections, at most half the process's descriptor limit. One more displaces the
    # oldest connection still sending its headers; when every one has a request, it gets 503.
    max_connections: int = Field(4096, ge=1)
    # A request head still incomplete past this many bytes gets 400 (h11's
    # max_incomplete_event_size; a complete head read at once may be larger).
    max_header_bytes: int = Field(16 * 1024, ge=1024)
