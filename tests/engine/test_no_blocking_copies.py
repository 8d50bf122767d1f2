"""No copy to the device in a step waits for the GPU.

`torch.tensor(values, device=...)` and `.to(device)` without `non_blocking` synchronise the
stream: the host stops until every kernel queued so far has run (from inside a step, that is
the step so far). On CPU nothing can wait, so this test checks the calls themselves: while the
engine steps (prefill, decode through the graph buffers, sampling with every filter and
logprobs) and moves KV through its API, halfmoon's code asks for no blocking device copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.kvstore.layout import LayerKV

PACKAGE = str(Path(__file__).resolve().parents[2])


def _names_a_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    for arg in args:
        if isinstance(arg, (torch.device, torch.Tensor)):
            return True
        if isinstance(arg, str) and arg.split(":")[0] in ("cpu", "cuda"):
            return True
    return False


def _ours(depth: int = 2) -> str | None:
    """The caller's file when it is halfmoon's own code (not a test, not a library)."""
    name = sys._getframe(depth).f_code.co_filename
    if name.startswith(PACKAGE) and "/tests/" not in name and "/.venv/" not in name:
        return f"{name}:{sys._getframe(depth).f_lineno}"
    return None


def test_steps_and_kv_moves_request_no_blocking_device_copy(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir), num_pages=64, max_num_batched_tokens=64)
    engine = llm.engine
    engine.use_decode_buffers(capture=False)
    blocking: list[str] = []
    tensor, to = torch.tensor, torch.Tensor.to

    def spy_tensor(*args, **kwargs):
        if kwargs.get("device") is not None and (where := _ours()):
            blocking.append(f"torch.tensor(device=) at {where}")
        return tensor(*args, **kwargs)

    def spy_to(self, *args, **kwargs):
        asks = _names_a_device(args, kwargs) and not kwargs.get("non_blocking")
        if asks and (where := _ours()):
            blocking.append(f".to(device) at {where}")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy_tensor)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(max_tokens=6, temperature=1.0, stop=["zz"]),
    ]
    prompts = ["x" * 70, "The cache", "a b c"]
    outputs = llm.generate(prompts, params)
    kv_cache = engine.kv_cache
    kv = kv_cache.read_layer(1, [3, 4]).wait()
    kv_cache.write_layer(1, [5, 6], LayerKV(kv.k.clone(), kv.v.clone())).wait()
    assert all(out.token_ids for out in outputs)
    assert not blocking, blocking
