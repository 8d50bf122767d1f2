"""Small host values onto the device from inside a step, without waiting for the GPU."""

from __future__ import annotations

import torch


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None):
    """`values` as a tensor on `device`. Not `torch.tensor(values, device=device)`: that copy
    blocks until the stream has run everything queued so far (from inside a step, the step so
    far). On CUDA the values go through page-locked memory: a copy from pageable memory may
    hold the host until the GPU has taken it; the caching host allocator keeps the pinned
    block until the copy has run, so the host values may go away after the call."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
