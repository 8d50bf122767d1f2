"""The CPU engine tells glibc's allocator to keep freed buffers for the next forward pass."""

from __future__ import annotations

import platform
import sys

import pytest

from halfmoon.engine.cpu_memory import keep_freed_memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)
def test_glibc_accepts_every_threshold():
    keep_freed_memory.cache_clear()
    assert keep_freed_memory() is True
