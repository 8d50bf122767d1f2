"""The frontends' grammar builder (`cluster/frontend/grammar_checks.py`), a real process: a
grammar builds off the event loop, a bad one is refused naming its field, one past the deadline
is refused and only its forked child killed, a request that finds every build slot busy is
turned away as load, and a builder that dies is started again."""

from __future__ import annotations

import asyncio
import time

import pytest

from halfmoon.cluster.frontend.grammar_checks import GrammarChecks
from halfmoon.cluster.frontend.request_limits import RequestLimits
from halfmoon.cluster.serving.backend import RejectedError
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput

pytestmark = pytest.mark.timeout(120)
GOOD = StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
BAD = StructuredOutput("grammar", "root ::= x")
# Within the static limits, yet ~0.3-0.7 s to build: past a deadline of 50 ms.
SLOW = StructuredOutput(
    "json",
    '{"type": "object", "properties": {"a": {"type": "string", "pattern": "(b{1,10}){1,400}"}}}',
)


async def _gaps_while(work) -> tuple[object, float]:
    """`work`'s result and the longest the loop went without running a 10 ms ticker."""
    gaps, stop = [0.0], asyncio.Event()

    async def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    ticker = asyncio.create_task(tick())
    try:
        return await work, max(gaps)
    finally:
        stop.set()
        await ticker


def test_good_grammars_build_bad_ones_name_their_field_and_the_loop_runs_meanwhile():
    async def run():
        checks = GrammarChecks(RequestLimits(grammar_timeout_s=5.0))
        await checks.check([("response_format", GOOD)])  # starts the builder (loads xgrammar)
        _, gap = await _gaps_while(checks.check([("response_format", GOOD), ("guided_json", GOOD)]))
        with pytest.raises(InvalidRequestError) as raised:
            await checks.check([("a", GOOD), ("guided_grammar", BAD)])
        await checks.close()
        return gap, raised.value

    gap, error = asyncio.run(run())
    assert gap < 0.1
    assert error.field == "guided_grammar" and "not defined" in error.allowed


def test_a_grammar_past_the_deadline_is_refused_and_the_builder_serves_on_at_once():
    async def run():
        checks = GrammarChecks(RequestLimits(grammar_timeout_s=5.0))
        await checks.check([("x", GOOD)])
        pid = checks._builder.process.pid
        checks.timeout_s = 0.05
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as raised:
            await checks.check([("response_format.json_schema.schema", SLOW)])
        refused_s = time.monotonic() - started
        checks.timeout_s = 5.0
        started = time.monotonic()
        await checks.check([("x", GOOD)])  # the same builder: nothing reloads
        next_s = time.monotonic() - started
        same = checks._builder.process.pid == pid
        await checks.close()
        return raised.value, refused_s, next_s, same, checks.killed

    error, refused_s, next_s, same, killed = asyncio.run(run())
    assert error.field == "response_format.json_schema.schema"
    assert "did not build within 0.05 s" in error.allowed
    assert refused_s < 1.0 and killed == 1
    assert same and next_s < 0.5


def test_a_request_finding_every_build_slot_busy_is_turned_away_as_load(monkeypatch):
    from halfmoon.cluster.frontend import grammar_checks

    monkeypatch.setattr(grammar_checks, "QUEUE_TIMEOUT_S", 0.05)

    async def run():
        checks = GrammarChecks(RequestLimits(grammar_timeout_s=5.0, grammar_builders=1))
        await checks.check([("x", GOOD)])
        busy = asyncio.create_task(checks.check([("x", SLOW)]))
        await asyncio.sleep(0.01)
        with pytest.raises(RejectedError, match="every grammar build slot is busy"):
            await checks.check([("x", GOOD)])
        await busy
        await checks.close()

    asyncio.run(run())


def test_two_slots_build_at_once_and_a_dead_builder_is_started_again():
    async def run():
        checks = GrammarChecks(RequestLimits(grammar_timeout_s=5.0, grammar_builders=2))
        await checks.check([("x", GOOD)])
        both = [checks.check([("a", SLOW)]), checks.check([("b", BAD)])]
        results = await asyncio.gather(*both, return_exceptions=True)
        first = checks._builder.process
        first.kill()
        await first.wait()
        await checks.check([("x", GOOD)])  # a new builder
        restarted = checks._builder.process.pid != first.pid
        await checks.close()
        return results, restarted

    (slow, bad), restarted = asyncio.run(run())
    assert slow is None and isinstance(bad, InvalidRequestError) and bad.field == "b"
    assert restarted
