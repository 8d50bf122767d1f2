"""How many KV pages a worker gets: an explicit count, an explicit byte budget, or a share of the
device's memory (CUDA) after the weights, the step's activations and the runtime's own buffers
(decode graphs, library workspaces); on CPU a fixed budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_config import ModelConfig
from halfmoon.kernels.kv_quant import row_width

if TYPE_CHECKING:
    from halfmoon.engine.config import EngineConfig

log = logging.getLogger(__name__)

GiB = 1 << 30
# RAM the KV cache may take on CPU when no budget is given (vLLM's CPU backend defaults to 4 GiB).
CPU_KV_CACHE_BYTES = 2 * GiB


# What a CUDA engine holds beyond its weights, its KV pages and one eager step's activations:
# cuBLAS workspaces, sampling and page-index buffers, the allocator's partly used segments. The
# first GPU run (H200, two engines of a tiny model in one process, tests/engine/test_cuda_paths.py)
# found ~50 MB of it per engine past the share; this allowance is five times that.
CUDA_RUNTIME_BYTES = 256 << 20


@dataclass(slots=True)
class DeviceMemory:
    """A device's memory as `torch.cuda.mem_get_info` reports it, plus what the weights took."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int


def page_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of `block_size` tokens in every layer, stored in `dtype` (a
    quantized one with each row's scale)."""
    row = row_width(cfg.head_dim, dtype)
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row * dtype.itemsize


# The sampler's transient [rows, vocab] buffers in one step, in fp32 copies (an int64 tensor
# counts twice): the penalised and the masked copies of the logits, the temperature-scaled ones,
# top-k/top-p's sorted values and indices (3) and their cumulative sum, the probabilities,
# the min-p mask's and log_softmax's for logprobs. At N = 256 rows of a 152k vocabulary that is
# ~1.6 GB, which the KV budget must leave free (issue 51's reading put it at 6-8 copies).
SAMPLER_COPIES = 10


def forward_bytes(cfg: ModelConfig, max_batched_tokens: int, max_seqs: int) -> int:
    """A generous bound on one forward pass's activations: a few hidden-sized and MLP-sized
    buffers per token, and the fp32 logits of every sampled sequence."""
    per_token = 8 * cfg.hidden_size + mlp_floats(cfg)
    return 4 * (per_token * max_batched_tokens + 2 * max_seqs * cfg.vocab_size)


def mlp_floats(cfg: ModelConfig) -> int:
    """A token's MLP buffers: gate, up and their product; with experts, those of each of its k
    experts, their outputs before the sum, the router's scores and the shared expert's."""
    dense = 3 * cfg.intermediate_size
    if cfg.moe is None:
        return dense
    moe = cfg.moe
    routed = moe.top_k * (3 * moe.expert_intermediate_size + cfg.hidden_size) + moe.num_experts
    return max(dense, routed + 3 * moe.shared_expert_intermediate_size)


def sampler_bytes(cfg: ModelConfig, max_seqs: int) -> int:
    """The sampler's transient memory at `max_seqs` rows (`SAMPLER_COPIES` of the logits)."""
    return 4 * SAMPLER_COPIES * max_seqs * cfg.vocab_size


def activation_bytes(cfg: ModelConfig, max_batched_tokens: int, max_seqs: int) -> int:
    """One eager step's activations: the forward pass and the sampler's copies of its logits."""
    return forward_bytes(cfg, max_batched_tokens, max_seqs) + sampler_bytes(cfg, max_seqs)


def unbudgeted_cuda_bytes(cfg: ModelConfig, max_seqs: int, graphs: bool) -> int:
    """What a CUDA engine takes besides weights, KV and an eager step: the runtime's allowance,
    and with decode graphs their private pool (a decode forward's activations at the largest
    captured batch; the eager pool, where the sampler runs, does not lend to it)."""
    graph_pool = forward_bytes(cfg, max_seqs, max_seqs) if graphs else 0
    return CUDA_RUNTIME_BYTES + graph_pool


def kv_budget_bytes(
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    memory: DeviceMemory | None,
    activations_bytes: int,
) -> int:
    """The bytes the KV cache may take; `memory` is None on CPU."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if memory is None:
        return CPU_KV_CACHE_BYTES
    share = int(gpu_memory_utilization * memory.total_bytes)
    budget = share - memory.weights_bytes - activations_bytes
    # Other processes on the GPU (fractional num_gpus) may already hold part of our share.
    budget = min(budget, memory.free_bytes - activations_bytes)
    if budget <= 0:
        raise ModelLoadError(
            f"no GPU memory left for the KV cache: {gpu_memory_utilization:.2f} of "
            f"{memory.total_bytes / GiB:.1f} GiB minus {memory.weights_bytes / GiB:.2f} GiB of "
            f"weights and {activations_bytes / GiB:.2f} GiB of activations, "
            f"{memory.free_bytes / GiB:.2f} GiB free; raise --gpu-memory-utilization, "
            "lower max_num_batched_tokens, or set --kv-cache-memory"
        )
    return budget


def plan_num_pages(
    budget_bytes: int, bytes_per_page: int, pages_per_seq: int, max_seqs: int, capped: bool
) -> int:
    """Pages that fit the budget; `capped` stops at what `max_seqs` full sequences need (on CPU
    memory is shared and zeroed pages are not free)."""
    pages = budget_bytes // bytes_per_page
    if capped:
        pages = min(pages, max_seqs * pages_per_seq)
    if pages < 2:
        raise ModelLoadError(
            f"a KV budget of {budget_bytes} bytes holds {pages} pages of {bytes_per_page} bytes; "
            "at least 2 are needed: raise --kv-cache-memory or --gpu-memory-utilization"
        )
    return pages


def cuda_memory(device: torch.device, weights_bytes: int) -> DeviceMemory | None:
    """The device's memory now, or None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, weights_bytes)


def size_kv(
    config: EngineConfig,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights_bytes: int,
) -> tuple[int, int]:
    """(num_pages, max_model_len): the pages the budget allows and the context they can hold."""
    if config.max_model_len is not None and config.max_model_len > cfg.max_model_len:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} exceeds the model's context of "
            f"{cfg.max_model_len} tokens (max_position_embeddings / sliding window); lower it"
        )
    max_len = config.max_model_len or cfg.max_model_len
    pages_per_seq = -(-max_len // config.block_size)
    num_pages = config.num_pages
    if num_pages is None:
        activations = activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs)
        memory = cuda_memory(device, weights_bytes)
        if memory is not None:
            activations += unbudgeted_cuda_bytes(
                cfg, config.max_num_seqs, graphs=not config.enforce_eager
            )
        budget = kv_budget_bytes(
            config.kv_cache_memory_bytes, config.gpu_memory_utilization, memory, activations
        )
        capped = memory is None and config.kv_cache_memory_bytes is None
        # A rank holds its slice of the KV heads.
        bytes_per_page = page_bytes(cfg, config.block_size, dtype) // config.tensor_parallel_size
        num_pages = plan_num_pages(
            budget, bytes_per_page, pages_per_seq, config.max_num_seqs, capped
        )
    capacity = num_pages * config.block_size
    if config.max_model_len is not None and capacity < config.max_model_len:
        raise ModelLoadError(
            f"the KV cache holds {capacity} tokens ({num_pages} pages), fewer than "
            f"max_model_len={config.max_model_len}; give it more memory (--kv-cache-memory, "
            "--gpu-memory-utilization) or lower --max-model-len"
        )
    if capacity < max_len:
        log.info("context limited to %d tokens by the KV cache (%d pages)", capacity, num_pages)
    return num_pages, min(max_len, capacity)
