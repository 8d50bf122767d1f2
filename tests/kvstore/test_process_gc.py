"""Serving processes freeze their start-up heap, and every collection's pause is measured."""

from __future__ import annotations

import gc
import subprocess
import sys

from prometheus_client import CollectorRegistry

from halfmoon.kvstore import process_gc
from halfmoon.kvstore.process_gc import gc_pause_histogram

FREEZE = """
import gc
import torch  # a start-up heap of the size a worker has, roughly
from halfmoon.kvstore.process_gc import freeze_startup_heap
frozen = freeze_startup_heap("test")
print(frozen, gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_every_collection_is_counted_with_its_generation():
    registry = CollectorRegistry()
    registry.register(gc_pause_histogram())

    def count(generation: int) -> float:
        labels = {"generation": str(generation)}
        return registry.get_sample_value("halfmoon_gc_pause_seconds_count", labels)

    before = [count(g) for g in range(3)]
    gc.collect(2)
    gc.collect(0)
    after = [count(g) for g in range(3)]
    assert after[2] == before[2] + 1
    assert after[0] >= before[0] + 1
    assert registry.get_sample_value("halfmoon_gc_pause_seconds_sum", {"generation": "2"}) > 0


def test_a_registry_per_actor_shares_the_process_histogram():
    first, second = CollectorRegistry(), CollectorRegistry()
    first.register(gc_pause_histogram())
    second.register(gc_pause_histogram())  # one hook, however many registries expose it
    assert gc.callbacks.count(process_gc._on_gc) == 1
    gc.collect(2)
    labels = {"generation": "2"}
    name = "halfmoon_gc_pause_seconds_count"
    assert first.get_sample_value(name, labels) == second.get_sample_value(name, labels) > 0


def test_freezing_leaves_the_collector_only_what_comes_after():
    out = subprocess.run(
        [sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=120, check=True
    )
    frozen, freeze_count, still_tracked = map(int, out.stdout.split())
    assert frozen == freeze_count > 50_000
    assert still_tracked < frozen // 20, (frozen, still_tracked)
