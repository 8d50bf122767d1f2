"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from halfmoon.engine.mlp import MLP
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.moe_block import SparseMoeBlock
from halfmoon.engine.tensor_parallel import SINGLE, TPGroup, VocabParallelEmbedding, vocab_rows
from halfmoon.kernels import ops
from halfmoon.kernels.attention import AttentionMetadata, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """This rank's query and KV heads: `qkv_proj` column-, `o_proj` row-parallel."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads // group.size,
            cfg.num_kv_heads // group.size,
            cfg.head_dim,
        )
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, cos_sin, kv_cache, meta: AttentionMetadata):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        ops.rotary_embedding(positions, q, k, cos_sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.group.all_reduce(self.o_proj(out.reshape(-1, q_size)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg, group)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // group.size, group)

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """The whole model: `forward` returns final hidden states, `logits` projects chosen rows.
    With a `group` of T ranks, this rank's slice of it (see tensor_parallel.py)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config, self.group = cfg, group
        if group.size > 1:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        else:
            # `_weight` skips the random init (the checkpoint overwrites it), whose meta-device
            # `normal_` would import torch._dynamo: ~3 s of every worker's start.
            weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, group, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab = vocab_rows(cfg.vocab_size, group.size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(token_ids), None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if before_layer is not None:
                before_layer(index)
            x, residual = layer(x, residual, positions, cos_sin, kv_cache, meta)
            if after_layer is not None:
                after_layer(index)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of `hidden`'s rows; at T > 1 on rank 0 only (None on the others)."""
        logits = self.lm_head(hidden).float()
        if self.group.size == 1:
            return logits
        logits = self.group.gather_columns(logits)
        return None if logits is None else logits[:, : self.config.vocab_size]
