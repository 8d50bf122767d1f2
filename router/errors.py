"""Errors the router raises; the gRPC layer maps them to status codes in one place."""

from __future__ import annotations


class RouterConfigError(ValueError):
    """A router setting (policy name, admission mode, SLO, profile) is invalid."""


class ProfileError(RouterConfigError):
    """A cost-model profile file is missing a field or holds an impossible value."""


class TraceFormatError(ValueError):
    """A trace line is not a valid request record."""

    def __init__(self, path: str, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


class InvalidRequestError(ValueError):
    """A request carries a value the router cannot route with (an impossible SLO override)."""
