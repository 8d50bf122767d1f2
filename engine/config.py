"""Engine configuration: one validated schema, every default written here once."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from halfmoon.kvstore.config import BLOCK_SIZE


class EngineSettings(BaseModel):
    """What a deployment tunes per engine; the cluster's `engine:` section embeds these."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(BLOCK_SIZE, ge=1)
    # None sizes the KV pool from memory.
    num_pages: int | None = Field(None, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    # Tokens per prefill chunk; None: a prompt is prefilled as the token budget allows.
    prefill_chunk_size: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # The KV cache's format (kernels/kv_quant.py): "auto" keeps the model's dtype; the 8-bit
    # ones store each row quantized with its scale, on the device and on every path it moves.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"] = "auto"
    # None: the model's own context (max_position_embeddings / sliding window), or less if the
    # KV cache cannot hold it; a larger value than the model's is an error.
    max_model_len: int | None = Field(None, ge=2)
    # KV budget: None sizes it from the device (CUDA: this share of its memory; CPU: 2 GiB).
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # False replays decode steps from CUDA graphs on a GPU; True always runs them eagerly.
    enforce_eager: bool = False
    # Ranks the model is split across (tensor_parallel.py): rank 0 in this process, the others
    # in processes of their own, one device each. The KV budget is per rank.
    tensor_parallel_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _chunk_on_blocks(self) -> EngineSettings:
        chunk = self.prefill_chunk_size
        if chunk is not None and chunk % self.block_size:
            raise PydanticCustomError(
                "cross_field",
                "{reason}",
                {
                    "field": "prefill_chunk_size",
                    "reason": f"{chunk} must be a multiple of block_size = {self.block_size}",
                },
            )
        return self


class EngineConfig(EngineSettings):
    """How big the KV pool and the per-step batch are, and where the model runs."""

    model: str
    device: str = "auto"
    enable_prefix_caching: bool = True
    # Other processes of this node may open the KV cache (`PagedKvCache.export`): on CPU it is
    # allocated in shared memory; on CUDA it is shared by IPC handles. Prefill workers lend
    # their pages to decode workers this way (the device tier).
    share_kv: bool = False

    @model_validator(mode="after")
    def _share_one_rank(self) -> EngineConfig:
        if self.share_kv and self.tensor_parallel_size > 1:
            raise PydanticCustomError(
                "cross_field",
                "{reason}",
                {
                    "field": "share_kv",
                    "reason": "KV sharing needs tensor_parallel_size = 1 (each rank holds only "
                    f"its KV heads; got {self.tensor_parallel_size})",
                },
            )
        return self
