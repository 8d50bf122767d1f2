"""What users of an engine need to know of its model and KV layout, in one value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model an engine serves and how its KV is keyed: blocks of `block_size` tokens whose
    prefix-chain keys start at `root_key`, `num_layers` layers of pages per block."""

    model: str
    architecture: str
    vocab_size: int
    num_layers: int
    block_size: int
    root_key: bytes
    prefix_caching: bool
