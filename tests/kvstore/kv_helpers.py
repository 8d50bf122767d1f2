"""Helpers shared by the KV store tests: a small layout, random keys and payloads."""

from __future__ import annotations

import os

import torch

from halfmoon.kvstore.layout import KvLayout, LayerKV

LAYOUT = KvLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def make_keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def random_kv(n: int, seed: int = 0, layout: KvLayout = LAYOUT) -> LayerKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, *layout.page_shape)
    k = torch.randn(shape, generator=gen).to(layout.dtype)
    v = torch.randn(shape, generator=gen).to(layout.dtype)
    return LayerKV(k, v)


def assert_same(a: LayerKV, b: LayerKV) -> None:
    """Bit-exact equality of two payloads."""
    assert a.shape == b.shape and a.k.dtype == b.k.dtype
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
    assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
