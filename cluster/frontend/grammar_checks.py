"""The frontends' grammar check: each structured-output constraint a request sets is built with
xgrammar once before any worker sees it, off the event loop, in a process of its own
(`grammar_worker.py`), under a deadline.

The static limits (`engine/grammar_limits.py`) refuse what is known to be large before this;
what slips past them and does not build within `limits.grammar_timeout_s` is refused
(INVALID_ARGUMENT / 400 naming the field). The builder process loads xgrammar once (~270 MB:
it loads torch) on first use and forks a child per grammar, so `limits.grammar_builders`
grammars build at once and one past its deadline costs only its child, killed. A request that
waits more than `QUEUE_TIMEOUT_S` for a free slot is turned away as load (RESOURCE_EXHAUSTED /
429). Messages are JSON lines between this process and its own child: nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sys

from halfmoon.cluster.frontend.grammar_worker import TIMEOUT
from halfmoon.cluster.frontend.request_limits import RequestLimits
from halfmoon.cluster.serving.backend import RejectedError
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput, shown

log = logging.getLogger(__name__)
# How long a request may wait for a free build slot before it is turned away as load.
QUEUE_TIMEOUT_S = 5.0
# Past its deadline plus this, a build the builder has not answered means the builder itself is
# stuck: it is killed and started again.
BACKSTOP_S = 5.0


class GrammarChecks:
    """One builder process and `grammar_builders` builds at once; the limits'
    `grammar_timeout_s` bounds each."""

    def __init__(self, limits: RequestLimits) -> None:
        self.timeout_s, self.slots = limits.grammar_timeout_s, limits.grammar_builders
        self._free: asyncio.Semaphore | None = None
        self._builder: _Builder | None = None
        self._starting: asyncio.Lock | None = None
        self._warming: asyncio.Task | None = None
        self.killed = 0  # builds stopped at the deadline (for tests and logs)

    async def check(self, constraints: list[tuple[str, StructuredOutput]]) -> None:
        """Raise `InvalidRequestError` (naming its field) for the first constraint whose grammar
        cannot be built, or is not built within the deadline."""
        for field, structured in constraints:
            error = await self._build(structured)
            if error is not None:
                raise InvalidRequestError(field, shown(structured.spec), error)

    def warm(self) -> None:
        """Start the builder now, in the background (it takes seconds to load), rather than
        within the first constrained request's wait; a start that fails is retried then."""

        async def start() -> None:
            with contextlib.suppress(ConnectionError, OSError):
                await self._running()

        self._warming = asyncio.get_running_loop().create_task(start())

    async def close(self) -> None:
        if self._warming is not None:
            await self._warming
            self._warming = None
        if self._builder is not None:
            await self._builder.stop()
            self._builder = None

    async def _build(self, structured: StructuredOutput) -> str | None:
        try:
            await asyncio.wait_for(self._locks()[0].acquire(), QUEUE_TIMEOUT_S)
        except TimeoutError:
            raise RejectedError(
                f"every grammar build slot is busy ({self.slots}); retry shortly"
            ) from None
        try:
            builder = await self._running()
            answer = await asyncio.wait_for(
                builder.ask(structured, self.timeout_s), self.timeout_s + BACKSTOP_S
            )
        except (TimeoutError, ConnectionError):
            log.error("the grammar builder did not answer: starting it again")
            await self.close()
            raise RejectedError("the grammar builder restarted; retry shortly") from None
        finally:
            self._free.release()
        if answer != TIMEOUT:
            return answer
        self.killed += 1
        log.warning(
            "a %s grammar took over %g s to build: refused", structured.kind, self.timeout_s
        )
        return (
            f"its grammar did not build within {self.timeout_s:g} s: make it smaller (fewer "
            "or smaller counted repetitions, length bounds, nesting, alternatives)"
        )

    async def _running(self) -> _Builder:
        async with self._locks()[1]:
            if self._builder is None or self._builder.exited:
                self._builder = await _Builder.start()
            return self._builder

    def _locks(self) -> tuple[asyncio.Semaphore, asyncio.Lock]:
        """The build slots and the builder's start lock, made in the loop that uses them."""
        if self._free is None:
            self._free, self._starting = asyncio.Semaphore(self.slots), asyncio.Lock()
        return self._free, self._starting


def build_here(constraints: list[tuple[str, StructuredOutput]]) -> None:
    """What a builder does, in this process (no deadline): `InvalidRequestError` under the
    field's name for the first constraint whose grammar cannot be built."""
    from halfmoon.engine.grammar import check

    for field, structured in constraints:
        try:
            check(structured)
        except InvalidRequestError as error:
            raise error.renamed(field) from None


class _Builder:
    """The `grammar_worker.py` process: requests in as JSON lines with an id, answers out in
    the order the builds end."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}  # build id -> its answer, pending
        self._reader: asyncio.Task | None = None

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None or self._reader.done()

    @classmethod
    async def start(cls) -> _Builder:
        """A builder once its process has loaded xgrammar (seconds: it loads torch)."""
        command = [sys.executable, "-m", "halfmoon.cluster.frontend.grammar_worker"]
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        builder = cls(process)
        line = await process.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            await builder.stop()
            raise ConnectionError("the grammar builder did not start")
        builder._reader = asyncio.get_running_loop().create_task(builder._read())
        return builder

    async def ask(self, structured: StructuredOutput, timeout_s: float) -> str | None:
        """The reason the grammar cannot be built, `TIMEOUT`, or None once it built."""
        build_id = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[build_id] = answer
        request = {"id": build_id, "kind": structured.kind, "spec": structured.spec}
        line = json.dumps({**request, "timeout_s": timeout_s}) + "\n"
        try:
            self.process.stdin.write(line.encode())
            await self.process.stdin.drain()
            return await answer
        finally:
            self._waiting.pop(build_id, None)

    async def _read(self) -> None:
        while line := await self.process.stdout.readline():
            message = json.loads(line)
            answer = self._waiting.get(message["id"])
            if answer is not None and not answer.done():
                answer.set_result(message["error"])
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(ConnectionError("the grammar builder exited"))

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
