"""What happens to a placed request, as the Conductor hears of it (`Conductor.on_event`): each
event names the request and when it happened (`now`, monotonic seconds)."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.router.replication import Replication


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """The request's prefill finished (its first token is out of the engine)."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class DecodeJoined:
    """The request's KV landed and it joined its decode instance's running batch."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request's first token reached the client after `ttft_s`; `handoff_s` is its
    prefill's compute end to that token (None: prefilled where it decodes, no hand-off)."""

    request_id: str
    now: float
    ttft_s: float
    handoff_s: float | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The request finished, was cancelled or hit its deadline after `output_tokens`."""

    request_id: str
    now: float
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Abandoned:
    """The request's attempt was given up (its worker died; it is routed again): what it held
    is released without counting it as finished."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Replicated:
    """A hot-prefix copy planned by `route` landed or failed (the index learns of its blocks
    from block events); a copy serves no one request, so it names none."""

    copy: Replication
    now: float


Event = PrefillDone | DecodeJoined | FirstToken | Finished | Abandoned | Replicated
