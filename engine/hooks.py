"""Extension points through which the workers move KV into and out of the engine's pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from halfmoon.engine.scheduler import ScheduledSeq
    from halfmoon.engine.sequence import Sequence


class KVHooks:
    """Called by the engine as it admits sequences and runs layers; the defaults do nothing."""

    def external_prefix_blocks(self, seq: Sequence, first_block: int, max_blocks: int) -> int:
        """How many blocks after `first_block` of `seq` can be loaded from elsewhere (<= max)."""
        return 0

    def load_prefix(self, seq: Sequence, first_block: int, pages: list[int]) -> None:
        """Start loading blocks `first_block...` into `pages`; each layer must land before
        `before_layer` of that layer returns."""

    def writes_before(self, batch: list[ScheduledSeq]) -> bool:
        """Whether `before_layer` writes KV during this step (at tensor_parallel_size > 1 the
        other ranks then wait for it before each layer)."""
        return False

    def before_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        """Layer `layer` of this step is about to run."""

    def after_layer(self, layer: int, batch: list[ScheduledSeq]) -> None:
        """Layer `layer` of this step wrote its KV for every token of `batch`."""

    def sampled(self, seq: Sequence, token_id: int) -> None:
        """This step sampled `token_id` for `seq` (before it is appended or streamed)."""
