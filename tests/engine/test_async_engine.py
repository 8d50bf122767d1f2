"""The engine's step thread streams outputs to asyncio callers: all of them, in order, with one
wake-up of the event loop per step; its stats, steps and page events are read without waiting
for a step."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.async_engine import AsyncEngine, EngineFailure, _settle_each
from halfmoon.engine.errors import DeviceFailedError, is_device_failure

PROMPTS = [[10 + i, 20, 30 + i] * (i + 1) for i in range(6)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_streams_equal_the_offline_engine_with_one_wake_up_per_step(tiny_model_dir):
    expected = [o.token_ids for o in LLM(str(tiny_model_dir)).generate(PROMPTS, PARAMS)]
    engine = LLM(str(tiny_model_dir)).engine
    front = AsyncEngine(engine)

    async def main():
        loop = asyncio.get_running_loop()
        wake_ups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: wake_ups.append(a) or original(*a, **k)
        # (a wake-up that answers calls, `add_request` here, is not a step's: not counted)

        async def one(i):
            outs = [out async for out in front.generate(PROMPTS[i], PARAMS, f"r{i}")]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert all(o.timeline for o in outs), "each output names the step that made it"
            return [t for out in outs for t in out.new_token_ids]

        got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        return got, sum(1 for call in wake_ups if call[0] is not _settle_each)

    try:
        got, wake_ups = asyncio.run(main())
    finally:
        front.shutdown()
    assert got == expected
    num_steps = engine.stats().num_steps
    assert wake_ups <= num_steps, (wake_ups, num_steps)


def test_pages_given_back_while_idle_are_free_without_another_request(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), num_pages=16).engine
    front = AsyncEngine(engine)

    async def main():
        async for _ in front.generate(PROMPTS[5], PARAMS, "lent"):
            pass

    pages = front.call(lambda e: e.reserve(PROMPTS[5], PARAMS, "held"))
    front.call(lambda e: e.hold_pages(pages))
    front.call(lambda e: e.abort("held"))
    asyncio.run(main())
    assert front.call(lambda e: e.num_held_pages) == len(pages)
    assert front.stats()[0].num_used_pages == len(pages)
    engine.unhold_pages_later(pages)  # from another thread, as a lender does; then idle
    assert engine.num_held_pages == 0, "given back at once, as the lender's counter reads it"
    deadline = time.monotonic() + 2.0
    while front.stats()[0].num_used_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert front.stats()[0].num_used_pages == 0, "freed by the idle step loop"


def test_stats_steps_and_page_events_are_read_without_waiting_for_the_step(tiny_model_dir):
    engine = LLM(str(tiny_model_dir)).engine
    engine.record_page_events()  # as a worker does
    front = AsyncEngine(engine)

    async def main():
        async for _ in front.generate(PROMPTS[5], PARAMS, "r"):
            pass

    try:
        asyncio.run(main())
        # What a step in progress holds: a read that waited for it would never return here.
        with front._lock:
            stats, age_s = front.stats()
            steps = front.take_steps()
            events = front.take_page_events()
            assert front.take_steps() == [] and front.take_page_events() == []
    finally:
        front.shutdown()
    assert stats.num_generated_tokens == PARAMS.max_tokens and stats.num_running == 0
    assert 0.0 <= age_s < 10.0
    assert len(steps) == engine.stats().num_steps and sum(s.decode_seqs for s in steps) > 0
    assert events and {kind for kind, _ in events} == {"stored"}


def test_adding_and_aborting_while_a_step_runs_leave_the_event_loop_free(tiny_model_dir):
    # The step thread holds the engine for a whole step (seconds, for a long prefill on a
    # CPU): calls from the event loop are applied after it, while the loop serves the rest.
    front = AsyncEngine(LLM(str(tiny_model_dir)).engine)

    async def main():
        ticks = []

        async def tick():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        ticker = asyncio.create_task(tick())
        with front._lock:  # a step in progress
            added = asyncio.create_task(front.add_request(PROMPTS[0], PARAMS, "waits"))
            begun = time.monotonic()
            assert front.abort("nobody") is False  # returns at once
            await asyncio.sleep(0.5)
            assert not added.done()
            free = [t for t in ticks if t >= begun]
        assert await added == "waits"  # applied once the step let go
        outs = [out async for out in front.stream("waits")]
        ticker.cancel()
        return free, outs

    try:
        free, outs = asyncio.run(main())
    finally:
        front.shutdown()
    assert len(free) >= 10, "the loop ran on while the step held the engine"
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == PARAMS.max_tokens


def test_a_request_whose_caller_gave_up_while_it_was_being_added_is_dropped(tiny_model_dir):
    front = AsyncEngine(LLM(str(tiny_model_dir)).engine)

    async def main():
        with front._lock:  # a step in progress: the add waits for it
            adding = asyncio.create_task(front.add_request(PROMPTS[0], PARAMS, "gone"))
            await asyncio.sleep(0.05)
            adding.cancel()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not front.call(lambda e: e.requests) and not front._streams:
                return True
        return False

    try:
        assert asyncio.run(main()), "added, then aborted, and its stream forgotten"
    finally:
        front.shutdown()


def test_a_consumer_that_leaves_late_leaves_a_newer_request_under_its_id_alone(tiny_model_dir):
    # A router's retry may reach a worker before the stream of the attempt it replaced closes:
    # that stream's end must not close the retry's stream, nor abort the retry.
    front = AsyncEngine(LLM(str(tiny_model_dir)).engine)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        first = front.generate(PROMPTS[0], long, "same")
        await anext(first)
        front.abort("same")
        while await front.run(lambda engine: "same" in engine.requests):
            await asyncio.sleep(0.01)
        second = front.generate(PROMPTS[0], long, "same")
        outs = [await anext(second)]
        await first.aclose()  # the first attempt's consumer goes away only now
        outs += [out async for out in second]
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 30))  # before: the second stream hung
    finally:
        front.shutdown()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(len(out.new_token_ids) for out in outs) == 40


def test_a_reserve_records_its_pages_fence_on_the_step_thread(tiny_model_dir, monkeypatch):
    """The fence the decode worker's writes into reserved pages wait on is recorded on the step
    thread right after the reserve (before any later step is queued), not on the event loop
    after the await returns, a step late (issue 51)."""
    engine = LLM(str(tiny_model_dir), num_pages=16).engine
    marked = []

    def mark():
        marked.append(threading.current_thread().name)
        return "fence"

    monkeypatch.setattr(engine.kv_cache, "mark", mark)
    front = AsyncEngine(engine)
    try:
        pages, fence = asyncio.run(front.reserve(PROMPTS[5], PARAMS, "held"))
    finally:
        front.shutdown()
    assert fence == "fence" and len(pages) > 0
    assert marked == ["engine-step"]


def test_a_step_failed_on_its_device_ends_the_engine_and_its_health_check(tiny_model_dir):
    """A sticky device error (a CUDA illegal address keeps failing every later call while the
    process lives) is fatal: the requests in flight end with EngineFailure, new ones are
    refused with DeviceFailedError, and `check()` (the worker's ping) raises it so that the
    controller replaces the worker. Any other failed step keeps the engine serving."""
    engine = LLM(str(tiny_model_dir), num_pages=16).engine
    front = AsyncEngine(engine)
    step = engine.step
    raised = {"error": RuntimeError("boom: not the device")}

    def failing_step():
        error = raised.pop("error", None)
        if error is not None:
            raise error
        return step()

    engine.step = failing_step

    async def run(request_id: str) -> list:
        return [out async for out in front.generate(PROMPTS[5], PARAMS, request_id)]

    try:
        with pytest.raises(EngineFailure, match="boom"):
            asyncio.run(run("ordinary"))
        front.check()  # an ordinary failure: still serving
        assert asyncio.run(run("after"))[-1].finished
        raised["error"] = torch.AcceleratorError("CUDA error: an illegal memory access")
        with pytest.raises(EngineFailure, match="illegal memory access"):
            asyncio.run(run("sticky"))
        with pytest.raises(DeviceFailedError, match="device failed"):
            front.check()
        with pytest.raises(DeviceFailedError):
            asyncio.run(run("refused"))
    finally:
        front.shutdown()


def test_device_failures_are_told_from_ordinary_ones():
    assert is_device_failure(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_failure(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling ..."))
    assert not is_device_failure(RuntimeError("shape mismatch"))
    assert not is_device_failure(ValueError("CUDA error"))  # only what torch raises
