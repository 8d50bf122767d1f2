"""What users of an engine need to know of its model and KV layout, in one value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.kvstore.keys import model_root_key

if TYPE_CHECKING:
    import torch

    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model an engine serves and how its KV is keyed: blocks of `block_size` tokens whose
    prefix-chain keys start at `root_key`, `num_layers` layers of pages per block."""

    model: str
    architecture: str
    vocab_size: int
    num_layers: int
    block_size: int
    root_key: bytes
    prefix_caching: bool

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        model: ModelConfig,
        identity: str,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> ModelFacts:
        """The facts of `model` (its checkpoint's `identity`) computed in `dtype`, its KV stored
        in `kv_dtype` (None: `dtype`): its root key hashes the identity and the KV layout
        (`model_root_key`), the KV format too when it differs, so formats never share blocks."""
        layout = (model.num_layers, model.num_kv_heads, model.head_dim, config.block_size)
        kv = str(dtype) if kv_dtype in (None, dtype) else f"{dtype}|kv={kv_dtype}"
        return cls(
            model=config.model,
            architecture=model.architecture,
            vocab_size=model.vocab_size,
            num_layers=model.num_layers,
            block_size=config.block_size,
            root_key=model_root_key(identity, kv, *layout),
            prefix_caching=config.enable_prefix_caching,
        )
