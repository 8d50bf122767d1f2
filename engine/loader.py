"""Load a Hugging Face safetensors checkpoint (single file or sharded) into `CausalLM`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model import CausalLM
from halfmoon.engine.moe_weights import copy_moe_weight

# HF name pattern -> (our parameter, index of the shard within a fused parameter, or None).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def model_directory(model: str) -> Path:
    """The checkpoint directory, or a ModelLoadError that says how to get one."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model directory {model!r} does not exist: pass a Hugging Face checkpoint "
            "directory, or run `halfmoon init-model DIR` to create the default tiny model"
        )
    return model_dir


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
    """Copy the checkpoint into `model`, fusing q/k/v and gate/up and stacking experts
    (moe_weights.py); at T > 1 only this rank's slice of each tensor is read (see
    tensor_parallel.py)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                target = _copy(model, params, name, shard.get_slice(name))
                if target:
                    loaded.add(target)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ModelLoadError(
            f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:5])}"
        )


def _copy(model: CausalLM, params: dict, name: str, source) -> str | None:
    if model.config.moe is not None:
        target = copy_moe_weight(params, name, source, model.group.rank)
        if target:
            return target
    match = _LAYER.match(name)
    if match and match.group(3) in _FUSED:
        layer, block, proj, kind = match.groups()
        fused, shard = _FUSED[proj]
        target = f"layers.{layer}.{block}.{fused}.{kind}"
        start, size = _shard_of(model, fused, shard)
        first = model.group.rank * size
        params[target].data[start : start + size].copy_(source[first : first + size])
        return target
    target = name.removeprefix("model.")
    if target not in params:
        return None
    _copy_slice(name, params[target].data, source, model.group.size, model.group.rank)
    return target


def _shard_of(model: CausalLM, fused: str, shard: int) -> tuple[int, int]:
    """(first row, rows) of one of a fused parameter's parts, as this rank holds it."""
    cfg, ranks = model.config, model.group.size
    if fused == "gate_up_proj":
        sizes = [cfg.intermediate_size // ranks] * 2
    else:
        sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        sizes = [size // ranks for size in sizes]
    return sum(sizes[:shard]), sizes[shard]


def _copy_slice(name: str, param: torch.Tensor, source, ranks: int, rank: int) -> None:
    """Copy `source`, or this rank's slice of it along the one dimension the parameter holds
    a part of (row-parallel columns, vocabulary rows, the last rank's padded with zeros)."""
    shape, ours = list(source.get_shape()), list(param.shape)
    if shape == ours:
        param.copy_(source[:])
        return
    split = [dim for dim in range(len(ours)) if len(shape) == len(ours) and shape[dim] != ours[dim]]
    if len(split) != 1 or -(-shape[split[0]] // ranks) != ours[split[0]]:
        raise ModelLoadError(
            f"checkpoint tensor {name} of shape {shape} does not fit our parameter of "
            f"shape {ours} at tensor_parallel_size={ranks}"
        )
    dim = split[0]
    first = rank * param.shape[dim]
    count = max(0, min(param.shape[dim], shape[dim] - first))
    param.zero_()
    if count:
        part = source[(slice(None),) * dim + (slice(first, first + count),)]
        param.narrow(dim, 0, count).copy_(part)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, model_dir: Path, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    stored = json.loads((model_dir / "config.json").read_text())
    stored_name = stored.get("dtype") or stored.get("torch_dtype") or "bfloat16"
    return getattr(torch, stored_name) if stored_name != "float32" else torch.bfloat16
