"""An engine's model, loaded: the checkpoint on its device with its tokenizer, and its KV pages
sized to the memory budget and allocated, in the order that lets each step fail early."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.kv_cache import PagedKvCache
from halfmoon.engine.kv_sizing import size_kv
from halfmoon.engine.loader import model_directory, pick_device, pick_dtype
from halfmoon.engine.model_config import ModelConfig, load_model_config
from halfmoon.engine.model_digest import model_identity
from halfmoon.engine.model_facts import ModelFacts
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.tokenizer import load_tokenizer
from halfmoon.kernels.kv_quant import storage_dtype


@dataclass(slots=True)
class LoadedModel:
    """What `load_model` made of a checkpoint: an engine's model side."""

    config: ModelConfig  # `max_model_len`: the context its KV pages can hold
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner
    kv_cache: PagedKvCache
    num_pages: int
    facts: ModelFacts


def load_model(config: EngineConfig) -> LoadedModel:
    """Load `config.model` on its device and allocate as many KV pages as its budget allows."""
    model_dir = model_directory(config.model)
    cfg = load_model_config(model_dir)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, model_dir, device)
    tokenizer = load_tokenizer(model_dir)
    runner = ModelRunner.start(model_dir, cfg, config, dtype, device)
    kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)
    num_pages, cfg.max_model_len = size_kv(config, cfg, kv_dtype, device, runner.weights_bytes)
    return LoadedModel(
        config=cfg,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        runner=runner,
        kv_cache=runner.allocate_kv(num_pages, cfg.max_model_len, config.share_kv, kv_dtype),
        num_pages=num_pages,
        facts=ModelFacts.of(config, cfg, model_identity(model_dir), dtype, kv_dtype),
    )
