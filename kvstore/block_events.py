"""What a tier says when blocks enter or leave it; the router's prefix index is built from these
(DESIGN.md, "Index")."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["stored", "evicted"]


@dataclass(slots=True)
class BlockEvent:
    """Blocks stored in or evicted from one tier of one instance."""

    kind: EventKind
    instance: str
    tier: str
    keys: list[Hashable] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "evicted"):
            raise ValueError(f"BlockEvent kind must be 'stored' or 'evicted', got {self.kind!r}")
