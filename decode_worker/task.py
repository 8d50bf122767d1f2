"""What the router sends a decode worker: `DecodeTask`, for a reserve (disaggregated) or a
whole request (colocated, or a bypassed short prompt)."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.cluster.worker.task import RequestTask


@dataclass(slots=True)
class DecodeTask(RequestTask):
    """One attempt on a decode worker: the prompt, its full-block keys (hashed once, by the
    router) and where its KV comes from.

    `store_name`: the store node the prefill worker publishes to (default: this node's).
    `ticket` names the attempt for `abort`. `direct`: the prefill worker was given this
    worker's notice socket, so on one node the layers come from its notices.
    `first_token_id`: the request's first token when already known (a retry): it joins the
    batch as soon as its KV is in; with `params.n` > 1, a list of each sequence's."""

    store_name: str | None = None
    ticket: str | None = None
    direct: bool = False
    first_token_id: int | list[int] | None = None
