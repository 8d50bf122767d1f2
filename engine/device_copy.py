"""Small host values onto the device from inside a step, without waiting for the GPU."""

from __future__ import annotations

import torch


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None):
    """`values` as a tensor on `device`. Not `torch.tensor(values, device=device)`: that copy
    blocks until the stream has run everything queued so far (from inside a step, the step so
    far). A non-blocking copy from pageable memory is staged by CUDA at once, so the host
    values may go away after the call."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
