"""Paged KV caches with shuffled pages, and the per-dtype tolerances every kernel test states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

# fp16 outputs round to ~1e-3 near 1.0, and the kernels round probabilities to fp16 for P @ V.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),  # bf16 keeps 8 bits: ~4e-3 steps near 1.0
}
# Where the tests' tensors live: on a CUDA host the kernels run compiled, and compiled Triton
# kernels take CUDA tensors only (a CPU one fails "cannot be accessed from Triton").
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def on_kernel_device(request):
    """Tensors made without a device go to `DEVICE`; tests of a whole engine pick their own,
    and the CPU kernels' tests (`test_cpu_*.py`) keep theirs on the CPU on any host."""
    on_cpu = request.path.name.startswith("test_cpu_")
    if DEVICE.type == "cpu" or on_cpu or "tiny_model_dir" in request.fixturenames:
        yield
        return
    with DEVICE:
        yield


@dataclass(slots=True)
class PagedKV:
    """One layer's K/V pages and a block table row per sequence, padded with -1."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor


def make_paged_kv(
    lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> PagedKV:
    """Random K/V for sequences of `lens` tokens, each on pages scattered over the pool."""
    pages = [-(-length // block_size) for length in lens]
    num_pages = sum(pages) + 3
    k_cache = torch.randn(num_pages, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_pages, block_size, num_kv_heads, head_dim).to(dtype)
    order = torch.randperm(num_pages)
    tables = torch.full((len(lens), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(pages):
        tables[seq, :count] = order[used : used + count]
        used += count
    return PagedKV(k_cache, v_cache, tables)


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """The `make_paged_kv` factory, seeded so every test sees the same data."""
    torch.manual_seed(0)
    return make_paged_kv


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Compare a kernel's output with its reference at the tolerance of the output's dtype."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[expected.dtype]
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)

    return check
