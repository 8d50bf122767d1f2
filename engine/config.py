"""Engine configuration: one validated dataclass, every default written here once."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.engine.errors import InvalidRequestError


@dataclass(slots=True)
class EngineConfig:
    """How big the KV pool and the per-step batch are, and where the model runs."""

    model: str
    block_size: int = 16
    num_pages: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    # KV budget: None sizes it from the device (CUDA: this share of its memory; CPU: 2 GiB).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    prefill_chunk_size: int | None = None
    # False replays decode steps from CUDA graphs on a GPU; True always runs them eagerly.
    enforce_eager: bool = False
    # Other processes of this node may open the KV cache (`PagedKvCache.export`): on CPU it is
    # allocated in shared memory; on CUDA it is shared by IPC handles. Prefill workers lend
    # their pages to decode workers this way (the device tier).
    share_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(name, value, "must be an integer >= 1")
        if self.num_pages is not None and (
            not isinstance(self.num_pages, int) or self.num_pages < 2
        ):
            raise InvalidRequestError(
                "num_pages", self.num_pages, "must be None or an integer >= 2"
            )
        chunk = self.prefill_chunk_size
        if chunk is not None and (
            not isinstance(chunk, int) or chunk < 1 or chunk % self.block_size
        ):
            raise InvalidRequestError(
                "prefill_chunk_size",
                chunk,
                f"must be None or a multiple of block_size={self.block_size}",
            )
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise InvalidRequestError(
                "max_model_len", self.max_model_len, "must be None or an integer >= 2"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InvalidRequestError(
                "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be None or > 0 bytes"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise InvalidRequestError(
                "dtype", self.dtype, "one of auto, float32, float16, bfloat16"
            )
