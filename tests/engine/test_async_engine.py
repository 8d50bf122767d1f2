"""The engine's step thread streams outputs to asyncio callers: all of them, in order, with one
wake-up of the event loop per step."""

from __future__ import annotations

import asyncio
import time

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.async_engine import AsyncEngine

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

        async def one(i):
            outs = [out async for out in front.generate(PROMPTS[i], PARAMS, f"r{i}")]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert all(o.timeline for o in outs), "each output names the step that made it"
            return [t for out in outs for t in out.new_token_ids]

        got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        return got, len(wake_ups)

    try:
        got, wake_ups = asyncio.run(main())
    finally:
        front.shutdown()
    assert got == expected
    assert wake_ups <= engine.num_steps, (wake_ups, engine.num_steps)


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
    held = front.call(lambda e: e.num_held_pages)
    assert held == len(pages)
    engine.unhold_pages_later(pages)  # from another thread, as a lender does; then idle
    deadline = time.monotonic() + 2.0
    while front.call(lambda e: e.num_held_pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert front.call(lambda e: e.num_held_pages) == 0
