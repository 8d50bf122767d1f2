"""The router's settings, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from halfmoon.kvstore.config import BLOCK_SIZE
from halfmoon.router.errors import RouterConfigError

POLICY_NAMES = ("random", "round_robin", "least_loaded", "cache_aware_local", "conductor")
ADMISSION_MODES = ("none", "early_rejection", "prediction_early_rejection")


def check_slo(name: str, value: float | None) -> None:
    """Raise RouterConfigError unless `value` is None (no SLO) or a positive finite number."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RouterConfigError(f"{name} = {value!r} must be a number of seconds or unset")
    if not math.isfinite(value) or value <= 0:
        raise RouterConfigError(
            f"{name} = {value!r} can never be met; give a positive, finite number of seconds "
            "or leave it unset for no SLO"
        )


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise RouterConfigError, listing `choices`, unless `value` is one of them."""
    if value not in choices:
        raise RouterConfigError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")


@dataclass(slots=True)
class RouterConfig:
    """Policy, admission mode, SLOs and the knobs of cache-aware placement."""

    policy: str = "conductor"
    admission: str = "none"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    # Reject at arrival a request whose predicted TTFT exceeds this (in any admission mode;
    # None: no bound). Unlike a count of queued requests, it holds whatever their lengths.
    max_ttft_s: float | None = None
    block_size: int = BLOCK_SIZE
    # Fetch a remote prefix only when it saves at least this much more than it costs to move.
    fetch_margin_s: float = 0.01
    # Prefill on the decode instance when at most this many tokens are uncached (0 turns it off).
    bypass_max_tokens: int = 512
    # Longest decode step a bypassed prefill may cause when no TBT SLO is set.
    bypass_max_stall_s: float = 0.1
    default_output_tokens: int = 256
    explain_capacity: int = 4096
    seed: int = 0
    # Copy hot prefixes toward idle prefill instances (router/replication.py). Off: on the
    # bundled traces and profiles it moves mean TTFT by under 0.3 % (docs/router.md).
    replicate: bool = False
    # A prefix is hot once this many of the recent requests reached it.
    replicate_min_hits: int = 2
    # "Recent" is the last 1x to 2x this many requests.
    replicate_window_requests: int = 1000
    # No copy once this many prefill instances hold the prefix.
    replicate_max_copies: int = 4
    # Copy only when the target's queue is this many seconds shorter than every holder's.
    replicate_margin_s: float = 0.1
    # A planned copy blocks another of the same prefix until it lands or this passes.
    replicate_cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        check_choice("routing policy", self.policy, POLICY_NAMES)
        check_choice("admission mode", self.admission, ADMISSION_MODES)
        check_slo("ttft_slo_s", self.ttft_slo_s)
        check_slo("tbt_slo_s", self.tbt_slo_s)
        check_slo("max_ttft_s", self.max_ttft_s)
        if self.admission != "none" and self.ttft_slo_s is None and self.tbt_slo_s is None:
            raise RouterConfigError(
                f"admission {self.admission!r} rejects against an SLO; set ttft_slo_s or tbt_slo_s"
            )
        if self.block_size <= 0:
            raise RouterConfigError(
                f"block_size = {self.block_size} must be a positive token count"
            )
        if self.bypass_max_tokens < 0 or self.explain_capacity < 0:
            raise RouterConfigError(
                "bypass_max_tokens and explain_capacity must be >= 0, got "
                f"{self.bypass_max_tokens} and {self.explain_capacity}"
            )
        if self.default_output_tokens <= 0:
            raise RouterConfigError(
                f"default_output_tokens = {self.default_output_tokens} must be positive"
            )
        self._check_replication()

    def _check_replication(self) -> None:
        for name in ("replicate_min_hits", "replicate_window_requests", "replicate_max_copies"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RouterConfigError(f"{name} = {value!r} must be a whole number >= 1")
        for name in ("replicate_margin_s", "replicate_cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RouterConfigError(f"{name} = {value!r} must be a number of seconds")
            if not math.isfinite(value) or value < 0:
                raise RouterConfigError(f"{name} = {value!r} must be a finite number >= 0")
