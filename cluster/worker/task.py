"""`RequestTask`: what every worker task carries, the prompt and its block keys."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestTask:
    """One request's prompt and its full-block keys (hashed once, by the router); each
    worker's task adds where the KV comes from or goes."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_keys: list[bytes]
    # The prompt's last tokens that an earlier attempt generated (a migrated request is
    # prefilled again with its output so far): frequency and presence penalties count them.
    num_prior_output_tokens: int = 0
