"""A mixture-of-experts checkpoint's expert weights into `SparseMoeBlock`'s stacked ones.

Checkpoints on the hub store one tensor per expert and projection (Mixtral's
`block_sparse_moe.experts.E.w1/w3/w2`, Qwen's `mlp.experts.E.gate_proj/up_proj/down_proj`);
transformers 5 may save them stacked (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
`mlp.experts.down_proj` `[E, H, I]`). Either lands in this rank's slice of each expert's
intermediate size; the shared expert's gate and up fuse as a dense MLP's do."""

from __future__ import annotations

import re

import torch

_BLOCK = r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
_STACKED = re.compile(_BLOCK + r"experts\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(_BLOCK + r"shared_expert\.(gate_proj|up_proj)\.weight$")
_ROUTER = re.compile(_BLOCK + r"gate\.weight$")
# Which half of the fused gate/up rows a projection fills; None: the down projection.
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": None, "down_proj": None}
_ONE_EXPERT = re.compile(_BLOCK + rf"experts\.(\d+)\.({'|'.join(_PART)})\.weight$")


def copy_moe_weight(params: dict, name: str, source, rank: int) -> str | None:
    """Copy checkpoint tensor `name` (a safetensors slice) if it is an expert's, the shared
    expert's gate or up, or Mixtral's router; the parameter it filled, or None."""
    if match := _ONE_EXPERT.match(name):
        layer, expert, proj = match.groups()
        part = _PART[proj]
        target = f"layers.{layer}.mlp.experts.{'down_proj' if part is None else 'gate_up_proj'}"
        _copy_projection(params[target].data[int(expert)], source[:], part, rank)
        return target
    if match := _STACKED.match(name):
        layer, proj = match.groups()
        target = f"layers.{layer}.mlp.experts.{proj}"
        stacked = source[:]
        for expert, param in enumerate(params[target].data):
            _copy_stacked(param, stacked[expert], proj == "down_proj", rank)
        return target
    if match := _SHARED.match(name):
        layer, proj = match.groups()
        target = f"layers.{layer}.mlp.shared_expert.gate_up_proj.weight"
        _copy_projection(params[target].data, source[:], _PART[proj], rank)
        return target
    if match := _ROUTER.match(name):
        target = f"layers.{match.group(1)}.mlp.gate.weight"
        params[target].data.copy_(source[:])
        return target
    return None


def _copy_projection(param: torch.Tensor, weight: torch.Tensor, part: int | None, rank: int):
    """One projection's `weight` into this rank's fused gate/up rows (`part` 0 or 1) or, for
    the down projection (`part` None), into its columns."""
    if part is None:
        size = param.shape[1]
        param.copy_(weight[:, rank * size : (rank + 1) * size])
        return
    size = param.shape[0] // 2
    param[part * size : (part + 1) * size].copy_(weight[rank * size : (rank + 1) * size])


def _copy_stacked(param: torch.Tensor, weight: torch.Tensor, down: bool, rank: int) -> None:
    """One expert of a stacked tensor: its gate then up halves (`[2I, H]`), or down `[H, I]`."""
    if down:
        _copy_projection(param, weight, None, rank)
        return
    half = weight.shape[0] // 2
    for part in (0, 1):
        _copy_projection(param, weight[part * half : (part + 1) * half], part, rank)
