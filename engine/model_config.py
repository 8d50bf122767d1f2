"""The model's shape, read from a Hugging Face config, for every supported architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from halfmoon.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    max_model_len: int


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `config.json` through `transformers.AutoConfig`."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json: pass a Hugging Face checkpoint "
            "directory, or run `halfmoon init-model DIR` to create the default tiny model"
        )
    hf = AutoConfig.from_pretrained(path)
    architecture = (getattr(hf, "architectures", None) or ["<none>"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} in {path} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    max_positions = hf.max_position_embeddings
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        eos_token_ids=_eos_ids(hf),
        max_model_len=min(max_positions, _sliding_window(hf) or math.inf),
    )


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (eos,)


def _sliding_window(hf) -> int | None:
    # We attend over the full context; cap the context where a sliding window would differ.
    window = getattr(hf, "sliding_window", None)
    if window is None or getattr(hf, "use_sliding_window", True) is False:
        return None
    return int(window)
