"""A thread gives back the OpenMP worker threads its torch calls started (openmp_pool), so an
engine stepped on its own thread does not share the CPUs with another thread's idle pool."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from halfmoon.engine.openmp_pool import release_thread_pool


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_work() -> None:
    """A torch op large enough to open a parallel region on every intra-op thread."""
    torch.ones(1 << 22).mul_(2.0).sum()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def run_in_thread(fn) -> list:
    """`fn()`'s result, called on a fresh thread that stays alive until this returns it."""
    result, done, finish = [], threading.Event(), threading.Event()

    def body():
        torch.set_num_threads(2)  # OpenMP's team size is per thread
        result.append(fn())
        done.set()
        finish.wait()

    thread = threading.Thread(target=body)
    thread.start()
    done.wait()
    counted = num_threads()
    finish.set()
    thread.join()
    return [*result, counted]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_thread_releases_the_openmp_workers_it_started(two_threads):
    baseline = num_threads()
    # A thread that ran parallel work keeps its pool's worker alive while it lives ...
    _, kept = run_in_thread(parallel_work)
    # ... and a thread that gave it back does not.
    released, without = run_in_thread(lambda: (parallel_work(), release_thread_pool())[1])
    if not released:
        pytest.skip("torch's OpenMP runtime is not libgomp")
    assert kept > baseline + 1  # the thread itself and at least one OpenMP worker
    assert without == baseline + 1  # the thread alone


def test_releasing_without_a_pool_is_harmless():
    assert release_thread_pool() in (True, False)
    parallel_work()  # a later region starts a new pool
    release_thread_pool()
