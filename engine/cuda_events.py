"""CUDA events that another thread waits on (`synchronize()`): built blocking, so the waiting
thread sleeps until the GPU passes the event instead of spinning a CPU core at 100 %."""

from __future__ import annotations

import torch


def waited_event() -> torch.cuda.Event:
    """An event to record here and `synchronize()` on from another thread."""
    return torch.cuda.Event(blocking=True)
