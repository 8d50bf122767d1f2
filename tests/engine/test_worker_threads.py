"""A worker actor gives torch one thread per whole CPU Ray assigned it, whatever it inherited,
and hands the GIL between its threads sooner than Python's default."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import ray
import torch

from halfmoon.cluster.worker import actor as worker_base


def _context(mode: int, cpus: float | None):
    resources = {} if cpus is None else {"CPU": cpus}
    worker = SimpleNamespace(mode=mode)
    return SimpleNamespace(worker=worker, get_assigned_resources=lambda: resources)


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("cpus", "threads"), [(0.25, 1), (1.0, 1), (2.0, 2), (2.5, 2), (None, 1)])
def test_actor_threads_follow_rays_assigned_cpus(monkeypatch, restore_threads, cpus, threads):
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _context(ray.WORKER_MODE, cpus))
    assert worker_base.use_assigned_cpus() == threads
    assert torch.get_num_threads() == threads


def test_outside_an_actor_torch_keeps_its_threads(monkeypatch, restore_threads):
    before = torch.get_num_threads()
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _context(ray.SCRIPT_MODE, 4.0))
    assert worker_base.use_assigned_cpus() is None
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("mode", [ray.WORKER_MODE, ray.SCRIPT_MODE])
def test_an_actor_hands_the_gil_over_within_half_a_millisecond(monkeypatch, mode):
    before = sys.getswitchinterval()
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _context(mode, 1.0))
    try:
        interval = worker_base.hand_the_gil_over_sooner()
        if mode == ray.WORKER_MODE:
            assert interval == worker_base.SWITCH_INTERVAL_S == sys.getswitchinterval() == 0.0005
        else:
            assert interval is None and sys.getswitchinterval() == before
    finally:
        sys.setswitchinterval(before)
