"""The Triton backend: the same functions, signatures and semantics as `reference`."""

from __future__ import annotations

from halfmoon.kernels.triton_cache import gather_pages, scatter_pages, store_kv
from halfmoon.kernels.triton_decode import paged_decode_attention
from halfmoon.kernels.triton_norm import rms_norm, rotary_embedding
from halfmoon.kernels.triton_prefill import prefill_attention

__all__ = [
    "gather_pages",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "scatter_pages",
    "store_kv",
]
