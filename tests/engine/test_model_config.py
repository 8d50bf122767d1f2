"""`load_model_config` reads config.json itself (no transformers import): it must give what
transformers' own config classes give, defaults included, for every supported architecture."""

from __future__ import annotations

import json
import math

import pytest

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, load_model_config
from halfmoon.engine.moe_config import MoeShape

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def through_transformers(model_dir) -> ModelConfig:
    """The same fields read through `transformers.AutoConfig` (how halfmoon read them before)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    architecture = hf.architectures[0]
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    num_heads = hf.num_attention_heads
    eos = getattr(hf, "eos_token_id", None)
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False:
        window = None
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=_has_qkv_bias(hf),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        max_model_len=min(hf.max_position_embeddings, window or math.inf),
        moe=_experts_as_built(hf),
    )


def _has_qkv_bias(hf) -> bool:
    """Whether transformers' attention built from `hf` has a q_proj bias (on the meta device)."""
    return _meta_model(hf).model.layers[0].self_attn.q_proj.bias is not None


def _meta_model(hf):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf)


def _experts_as_built(hf) -> MoeShape | None:
    """The experts of the model transformers builds from `hf` (on the meta device)."""
    layers = _meta_model(hf).model.layers
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    if not sparse:
        return None
    block = layers[sparse[0]].mlp
    shared = getattr(block, "shared_expert", None)
    mixtral = hf.architectures[0] == "MixtralForCausalLM"
    return MoeShape(
        num_experts=block.experts.gate_up_proj.shape[0],
        top_k=block.gate.top_k,
        expert_intermediate_size=block.experts.down_proj.shape[2],
        norm_topk_prob=True if mixtral else block.gate.norm_topk_prob,
        shared_expert_intermediate_size=0 if shared is None else shared.down_proj.in_features,
        sparse_layers=tuple(sparse),
        round_weights=not mixtral,
    )


def test_every_test_checkpoint_reads_as_transformers_reads_it(checkpoints):
    for name, path in checkpoints.items():
        assert load_model_config(path) == through_transformers(path), name


def _write(tmp_path, name: str, config: dict):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


# Hand-written config.json files: the bare minimum (every default taken), and the rope and
# sliding-window spellings real checkpoints use.
CASES = {
    **{
        f"bare-{model_type}": {"architectures": [arch], "model_type": model_type}
        for arch, model_type in MODEL_TYPES.items()
    },
    "llama3-legacy-rope-scaling": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128008, 128009],
    },
    "linear-rope-old-type-key": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "rope-parameters": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "num_key_value_heads": None,
    },
    "mistral-no-window": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": None,
        "head_dim": None,
        "max_position_embeddings": 32768,
    },
    # Qwen3-30B-A3B's spelling (`num_experts`, as on the hub) with some dense layers.
    "qwen3-moe-hub-keys": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 6,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "head_dim": 128,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
    "mixtral-window": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "sliding_window": 4096,
        "rope_theta": 1e6,
    },
    "qwen2-window-on": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 1024,
        "max_window_layers": 0,
        "eos_token_id": 151643,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hand_written_configs_read_as_transformers_reads_them(tmp_path, case):
    path = _write(tmp_path, case, CASES[case])
    assert load_model_config(path) == through_transformers(path)


def test_every_supported_architecture_has_a_case():
    assert sorted(MODEL_TYPES) == sorted(SUPPORTED_ARCHITECTURES)


def test_broken_config_files_fail_with_the_file_named(tmp_path):
    path = tmp_path / "broken"
    path.mkdir()
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        load_model_config(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        load_model_config(path)
    (path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": "wide"})
    )
    with pytest.raises(ModelLoadError, match="not a valid LlamaForCausalLM config"):
        load_model_config(path)
