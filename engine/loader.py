"""Load a Hugging Face safetensors checkpoint (single file or sharded) into `CausalLM`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model import CausalLM

# HF name pattern -> (our parameter, index of the shard within a fused parameter, or None).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint into `model`, fusing q/k/v and gate/up."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = _copy(model, params, name, shard.get_tensor(name))
                if target:
                    loaded.add(target)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ModelLoadError(
            f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}"
        )


def _copy(model: CausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    match = _LAYER.match(name)
    if match and match.group(3) in _FUSED:
        layer, block, proj, kind = match.groups()
        fused, shard = _FUSED[proj]
        target = f"layers.{layer}.{block}.{fused}.{kind}"
        _shard_of(model, params[target], fused, shard).copy_(tensor)
        return target
    target = name.removeprefix("model.")
    if target not in params:
        return None
    params[target].data.copy_(tensor)
    return target


def _shard_of(model: CausalLM, param: torch.Tensor, fused: str, shard: int) -> torch.Tensor:
    cfg = model.config
    if fused == "gate_up_proj":
        sizes = [cfg.intermediate_size] * 2
    else:
        sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    start = sum(sizes[:shard])
    return param.data[start : start + sizes[shard]]
