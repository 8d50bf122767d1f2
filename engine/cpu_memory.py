"""glibc's allocator told to keep the memory a CPU forward pass frees, for the next one.

By default glibc hands buffers over 128 KiB (a prefill GEMM's output, a decode chunk's gathered
pages) back to the OS when freed, and every step faults them in again, page by page: measured
on the 2-core machine, that doubled the CPU decode attention's time (issue 31). vLLM's CPU
build asks for tcmalloc in LD_PRELOAD to the same end; this needs nothing preloaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: buffers up to this come from the heap
TRIM_THRESHOLD_BYTES = 256 << 20  # free heap kept before any is given back
TOP_PAD_BYTES = 64 << 20  # the heap grows in steps this large


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds once per process; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    return all(libc.mallopt(option, value) == 1 for option, value in settings)
