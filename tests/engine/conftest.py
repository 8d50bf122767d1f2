"""Tiny random checkpoints of every supported architecture, built with transformers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from halfmoon.engine.init_model import TinyModelShape, build_tokenizer, ensure_model

SHAPE = TinyModelShape(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
COMMON = dict(SHAPE.dense_sizes(), initializer_range=0.08)
# Four experts of width 32, two per token; Qwen2-MoE's first layer dense (`mlp_only_layers`) and
# its shared expert 48 wide; Qwen3-MoE renormalising the top two as its checkpoints do.
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)


def _configs(vocab_size: int, eos: int):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    ids = dict(vocab_size=vocab_size, eos_token_id=eos, bos_token_id=0, pad_token_id=2)
    return {
        "llama": LlamaConfig(**COMMON, **ids),
        "llama3-rope": LlamaConfig(
            **COMMON,
            **ids,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**COMMON, **ids, head_dim=16),
        "qwen2": Qwen2Config(**COMMON, **ids, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, **ids, head_dim=16, tie_word_embeddings=False),
        "mixtral": MixtralConfig(
            **{**COMMON, "intermediate_size": 32}, **ids, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2-moe": Qwen2MoeConfig(
            **COMMON,
            **ids,
            **EXPERTS,
            num_experts=4,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
        ),
        "qwen3-moe": Qwen3MoeConfig(
            **COMMON, **ids, **EXPERTS, num_experts=4, head_dim=16, norm_topk_prob=True
        ),
    }


def build_checkpoint(root: Path, name: str, shard: bool = False) -> Path:
    """Save a seeded random model of architecture `name` with the byte-level tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = _configs(len(tokenizer), tokenizer.eos_token_id)[name]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / name
    model.save_pretrained(path, max_shard_size="200KB" if shard else "5GB")
    tokenizer.save_pretrained(path)
    return path


ARCHITECTURES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]
MOE_ARCHITECTURES = ["mixtral", "qwen2-moe", "qwen3-moe"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    built = {name: build_checkpoint(root, name) for name in ARCHITECTURES + MOE_ARCHITECTURES}
    built["llama-sharded"] = build_checkpoint(root / "sharded", "llama", shard=True)
    return built


@pytest.fixture
def tiny_8k_model_dir(tmp_path) -> Path:
    """A Llama of the test checkpoints' sizes with an 8k context, as `ensure_model` makes it."""
    return ensure_model(tmp_path / "tiny-8k", replace(SHAPE, max_position_embeddings=8192))
