"""transformers' own greedy generation: the reference the engine's tokens are checked against."""

from __future__ import annotations

import torch


def reference_model(model_dir, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The checkpoint as a transformers model (fp32 by default) that never stops early (like
    ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def greedy_tokens(model, ids: torch.Tensor, max_new_tokens: int, **generate_args) -> list[int]:
    """The tokens transformers' greedy `generate` appends to the one prompt in `ids`."""
    with torch.no_grad():
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            attention_mask=torch.ones_like(ids),
            pad_token_id=2,
            **generate_args,
        )
    return out[0, ids.shape[1] :].tolist()
