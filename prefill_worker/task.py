"""What the router sends a prefill worker (`PrefillTask`) and what it answers (`PrefillResult`)."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.cluster.worker.task import RequestTask
from halfmoon.engine.sequence import TokenLogprobs
from halfmoon.kvstore.transfer.channel import KvPeer


@dataclass(slots=True)
class PrefillTask(RequestTask):
    """One attempt's prefill: the prompt, its full-block keys (hashed once, by the router) and
    where its KV goes.

    `ticket` names the attempt for `abort`; `kv_peer` is the decode worker that reserved it,
    told of each layer directly when it is on this node; `fetch_from` is the store node of
    another node whose host tier the router found holds a deeper prefix than this node's:
    the prefix is loaded from there (layer by layer, like one from this node's store).
    `layerwise=False` sends the KV only after the whole prompt (the transfer benchmark's
    baseline); `lend=False` never lends this worker's pages; `arena_loads=False` reads a
    stored prefix as Ray objects even from this node's store (the prefix-load benchmark's
    baseline)."""

    ticket: str | None = None
    kv_peer: KvPeer | None = None
    fetch_from: str | None = None
    layerwise: bool = True
    lend: bool = True
    arena_loads: bool = True


@dataclass(slots=True)
class PrefillResult:
    """The first token (of each of the request's `n` sequences) and where the prefill's time
    went (wall-clock seconds since epoch)."""

    request_id: str
    first_tokens: list[tuple[int, TokenLogprobs | None]]  # (token, its logprobs) by sequence
    num_prompt_tokens: int
    num_local_cached_tokens: int
    num_loaded_tokens: int
    loaded_from: str | None  # where the loaded tokens came from: a store node, or "redis"
    arrived_at: float
    started_at: float
    computed_at: float  # the engine produced the first token
    finished_at: float  # the call returned (its last layers may still be on their way)
    last_layer_published_at: float

    def stages(self) -> list[tuple[str, float]]:
        """(stage, wall-clock time on the worker) of the call, for the request's timeline."""
        return [
            ("prefill call began on the worker", self.arrived_at),
            ("prefill compute began", self.started_at),
            ("prefill compute ended", self.computed_at),
            ("last layer published", self.last_layer_published_at),
            ("prefill call returned on the worker", self.finished_at),
        ]

    @property
    def first_token_id(self) -> int:
        return self.first_tokens[0][0]
