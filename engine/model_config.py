"""The model's shape, read from a Hugging Face config, for every supported architecture."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.moe_config import MOE_ARCHITECTURES, MoeShape, moe_shape

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
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
    moe: MoeShape | None = None  # the experts of a mixture-of-experts model (moe_config.py)


# What transformers' config class of each architecture assumes for a key config.json leaves
# out (`save_pretrained` writes only values that differ from these). tests/engine/
# test_model_config.py checks every entry against transformers' own classes.
_DEFAULTS: dict[str, dict] = {
    "LlamaForCausalLM": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, head_dim=None,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=2, sliding_window=None,
    ),
    "MistralForCausalLM": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=None,
        max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=2, sliding_window=4096,
    ),
    "Qwen2ForCausalLM": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=None,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=None, sliding_window=4096, use_sliding_window=False,
    ),
    "Qwen3ForCausalLM": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=None, sliding_window=4096, use_sliding_window=False,
    ),
    "MixtralForCausalLM": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=None,
        max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=2, sliding_window=None, rope_theta=1e6,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    "Qwen2MoeForCausalLM": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, head_dim=None,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        qkv_bias=True, eos_token_id=None, sliding_window=4096, use_sliding_window=False,
        decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, mlp_only_layers=[],
    ),
    "Qwen3MoeForCausalLM": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=None,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, eos_token_id=None, sliding_window=4096, use_sliding_window=False,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
        num_experts=128, norm_topk_prob=False, mlp_only_layers=[],
    ),
}  # fmt: skip
DEFAULT_ROPE_THETA = 10000.0


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and check `config.json`, with transformers' defaults for the keys it leaves out.

    Read as JSON rather than through `transformers.AutoConfig`: importing a transformers
    config class costs ~3 s of CPU (it pulls in torch.distributed), paid by every worker."""
    path = Path(model_dir)
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(
            f"model directory {str(path)!r} has no config.json: pass a Hugging Face checkpoint "
            "directory, or run `halfmoon init-model DIR` to create the default tiny model"
        )
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {file}: {error}") from error
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, not {type(raw).__name__}")
    architecture = (raw.get("architectures") or ["<none>"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} in {path} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    hf = {**_DEFAULTS[architecture], **{k: v for k, v in raw.items() if v is not None}}
    for key in ("head_dim", "num_key_value_heads", "eos_token_id", "sliding_window"):
        if key in raw and raw[key] is None:  # an explicit null overrides a default
            hf[key] = None
    try:
        return _model_config(architecture, hf)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ModelLoadError(f"{file} is not a valid {architecture} config: {error!r}") from error


def _model_config(architecture: str, hf: dict) -> ModelConfig:
    # transformers 5 writes `rope_parameters` (with `rope_theta` inside); older checkpoints
    # write `rope_scaling` and a top-level `rope_theta`.
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf["head_dim"] or int(hf["hidden_size"]) // num_heads
    max_positions = int(hf["max_position_embeddings"])
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf["num_key_value_heads"] or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        qkv_bias=_qkv_bias(architecture, hf),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        eos_token_ids=_eos_ids(hf["eos_token_id"]),
        max_model_len=min(max_positions, _sliding_window(hf) or math.inf),
        moe=moe_shape(architecture, hf),
    )


def _qkv_bias(architecture: str, hf: dict) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE by its `qkv_bias`, the others by
    `attention_bias`."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture == "Qwen2MoeForCausalLM":
        return bool(hf["qkv_bias"])
    return bool(hf.get("attention_bias", False))


def _eos_ids(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, list | tuple) else (int(eos),)


def _sliding_window(hf: dict) -> int | None:
    # We attend over the full context; cap the context where a sliding window would differ.
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window", True) is False:
        return None
    return int(window)
