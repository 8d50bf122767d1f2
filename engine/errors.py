"""Errors the engine raises for bad input; each names the field and what is allowed."""

from __future__ import annotations


class HalfmoonError(Exception):
    """Base of every error halfmoon raises on purpose."""


class InvalidRequestError(HalfmoonError, ValueError):
    """A request field is out of range; the message names the field and the allowed range."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: {allowed}")
        self.field = field
        self.value = value


class ModelLoadError(HalfmoonError):
    """The model directory is missing, incomplete or of an unsupported architecture."""


class RequestNotFoundError(HalfmoonError, KeyError):
    """No request with this id is known to the engine."""


class OutOfPagesError(HalfmoonError):
    """Not enough free KV pages to hold a request right now; retry elsewhere or later."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"needs {needed} free KV pages, {free} are free")
        self.needed = needed
        self.free = free
