"""A memory file made for KV (the store's arena, a prefill worker's shared KV pages) has every
page allocated when it is made, so that no forward pass or layer copy pays the kernel's first
touch (issue 51: 19 % of a prefill worker's step thread was the kernel clearing such pages)."""

from __future__ import annotations

import os

import pytest
import torch

from halfmoon.engine.kv_cache import create_shared_kv
from halfmoon.kvstore import shared_arena

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create here")

SIZE = 8 << 20


def _allocated_bytes(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_a_new_arena_has_every_page_allocated_and_reads_zero():
    memory, path = shared_arena.create_arena(SIZE)
    assert _allocated_bytes(path) >= SIZE
    assert int(memory[:: 1 << 16].count_nonzero()) == 0


def test_without_madvise_populate_the_arena_is_zeroed_instead(monkeypatch):
    monkeypatch.setattr(shared_arena, "_madvise_populate", lambda memory: False)
    memory, path = shared_arena.create_arena(SIZE)
    assert _allocated_bytes(path) >= SIZE
    assert int(memory.count_nonzero()) == 0


def test_shared_kv_pages_are_allocated_before_the_first_write():
    path, layers = create_shared_kv(2, (64, 16, 2, 32), torch.float32)
    assert _allocated_bytes(path) >= 2 * 2 * 64 * 16 * 2 * 32 * 4
    assert len(layers) == 2 and layers[0][0].shape == (64, 16, 2, 32)
