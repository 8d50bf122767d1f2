"""The CUDA choices made off a GPU: events other threads wait on are blocking, page indices go
up from pinned memory, and a write after a reserve waits for the reserve's fence only.
tests/engine/test_cuda_paths.py checks the same on a GPU."""

from __future__ import annotations

import inspect

import torch

from halfmoon.engine import LLM, kv_cache
from halfmoon.engine.cuda_events import waited_event
from halfmoon.engine.device_copy import device_tensor


class Recorder:
    """Stands in for a CUDA object: records each call as (name, args, kwargs)."""

    def __init__(self, *args, **kwargs) -> None:
        self.calls = [("__init__", args, kwargs)]

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_a_waited_event_is_built_blocking(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", Recorder)
    assert waited_event().calls == [("__init__", (), {"blocking": True})]


def test_the_kv_cache_builds_every_event_blocking():
    # Its events are all waited on by other threads (the publisher, the receive's to_thread).
    source = inspect.getsource(kv_cache)
    assert "torch.cuda.Event(" not in source and source.count("waited_event()") == 4


def test_page_indices_go_to_a_gpu_from_pinned_memory(monkeypatch):
    steps = []

    def pin(tensor):
        steps.append("pin")
        return tensor

    def to(tensor, device, non_blocking=False):
        steps.append((str(device), non_blocking))
        return tensor

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    device_tensor([4, 5], torch.device("cuda"), torch.int64)
    device_tensor([4, 5], torch.device("cpu"), torch.int64)
    assert steps == ["pin", ("cuda", True), ("cpu", True)]


def test_a_write_with_a_fence_waits_for_it_not_for_the_compute_stream(tiny_model_dir):
    kv = LLM(str(tiny_model_dir), num_pages=8).engine.kv_cache
    stream = Recorder()
    kv._after_readers(stream, "fence")
    assert stream.calls[1:] == [("wait_event", ("fence",), {})]
