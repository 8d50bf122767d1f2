"""The router's answer for one request, with enough detail to explain it afterwards."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from halfmoon.router.replication import Replication


class Candidate(NamedTuple):
    """One instance the router considered and what it predicted there.

    A tuple rather than a dataclass: thousands are kept for `explain`, and tuples of plain
    values stay out of the garbage collector's way.
    """

    instance: Hashable
    role: str
    predicted_s: float
    note: str = ""


@dataclass(slots=True)
class Decision:
    """Where a request goes (or why it was rejected) and the predictions behind the choice."""

    request_id: str
    policy: str
    prefill_instance: Hashable | None = None
    decode_instance: Hashable | None = None
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    predicted_queue_s: float = 0.0
    cached_tokens: int = 0
    local_cached_tokens: int = 0
    fetch_from: tuple[Hashable, str] | None = None
    fetch_tokens: int = 0
    bypass: bool = False
    rejected: bool = False
    reason: str = ""
    prefill_degree: int = 1  # tensor-parallel degree of the instance that prefills it
    decode_degree: int = 1
    candidates: list[Candidate] = field(default_factory=list)
    replications: list[Replication] = field(default_factory=list)

    def explain(self) -> str:
        """A human-readable account of the candidates and why this one won."""
        lines = [f"request {self.request_id} policy={self.policy}"]
        if self.rejected:
            lines.append(f"  REJECTED: {self.reason}")
        else:
            fetch = (
                f" fetching {self.fetch_tokens} tokens from {self.fetch_from}"
                if self.fetch_from
                else ""
            )
            lines.append(
                f"  prefill={self.prefill_instance} decode={self.decode_instance}"
                f" tp={self.prefill_degree}/{self.decode_degree}"
                f" bypass={self.bypass} cached={self.cached_tokens} tokens{fetch}"
            )
            lines.append(
                f"  predicted ttft={self.predicted_ttft_s:.4f}s"
                f" (queue {self.predicted_queue_s:.4f}s)"
                f" tbt={self.predicted_tbt_s:.4f}s"
            )
        for copy in self.replications:
            lines.append(
                f"  replicate {len(copy.keys)} hot blocks ({copy.num_tokens} tokens to move)"
                f" from {copy.source} to {copy.target}"
            )
        for cand in sorted(self.candidates, key=lambda c: (c.role, c.predicted_s)):
            lines.append(
                f"    {cand.role:7s} {cand.instance!s:>12} {cand.predicted_s:.4f}s {cand.note}"
            )
        return "\n".join(lines)
