"""Lets a thread give back the OpenMP worker threads its torch calls started.

libgomp keeps one pool of worker threads per thread that opened a parallel region, and once it
manages more threads than the process has CPUs, every pool's idle workers stop spinning for the
next region and sleep at once (its "throttled" spin count). A worker actor builds its engine on
one thread and steps it on another (`AsyncEngine`): two pools of two threads on two CPUs, and
every step of a model of many small parallel regions paid a wake-up per region. Measured on the
2-core machine, fp32 ~50M model, batch 3: 22 ms a decode step on the building thread, 34 ms on
the step thread, 22 ms again once the building thread gave its pool back (issue 31).
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads released, state kept


def release_thread_pool() -> bool:
    """Release the calling thread's OpenMP worker threads (a later parallel region on this
    thread starts new ones); False where torch's OpenMP runtime is not libgomp."""
    library = _libgomp()
    if library is None:
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    import torch  # noqa: F401 - loads its libgomp first, which this then finds by soname

    try:
        library = ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None
    if not hasattr(library, "omp_pause_resource_all"):
        return None
    library.omp_pause_resource_all.argtypes = [ctypes.c_int]
    library.omp_pause_resource_all.restype = ctypes.c_int
    return library
