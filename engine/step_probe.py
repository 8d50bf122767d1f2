"""What the host adds to a decode step: the engine's step timed with the model's forward and
logits replaced by fixed tensors (scheduling, input copies, sampling, detokenization)."""

from __future__ import annotations

import time

import torch

from halfmoon.engine.llm_engine import LLMEngine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_step_time(engine: LLMEngine, batch_size: int, steps: int) -> float:
    """Seconds per decode step of the `batch_size` sequences the engine is decoding, with the
    model stubbed out; the engine is left as it was."""
    model, graphs, device = engine.model, engine.decode_graphs, engine.device
    hidden = torch.zeros(batch_size, model.config.hidden_size, device=device, dtype=engine.dtype)
    logits = torch.randn(batch_size, engine.facts.vocab_size, device=device)

    def graph_run(batch):
        graphs._load(batch, graphs.bucket_for(len(batch)))  # the input copies stay
        return hidden[: len(batch)]

    if graphs is not None:
        graphs.run = graph_run
    model.forward = lambda token_ids, *args, **kwargs: hidden[:1].expand(len(token_ids), -1)
    model.logits = lambda rows: logits[: len(rows)]
    try:
        for _ in range(3):
            engine.step()
        _sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        return (time.perf_counter() - started) / steps
    finally:
        for name in ("forward", "logits"):
            delattr(model, name)
        if graphs is not None:
            del graphs.run
