"""The grammar builder of `grammar_checks.py`, run as `python -m` in a process of its own.

It loads xgrammar once, says "ready", then reads one request a line (JSON: id, kind, spec,
timeout_s) and builds each grammar in a child forked for it (a few ms: the child shares the
loaded xgrammar), so several build at once and one that runs past its `timeout_s` is killed
without the builder reloading anything. Each child may allocate `CHILD_MEMORY_BYTES` more than
the builder holds; past it the build fails (as too large) instead of the machine swapping. One
line answers each request: JSON id and error (the reason it cannot be built, "timeout", or
null when it built). The builder ends when its input closes.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import sys
import time
from dataclasses import dataclass

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import FIELD, StructuredOutput

CHILD_MEMORY_BYTES = 2 << 30
TIMEOUT = "timeout"


@dataclass
class _Child:
    request_id: int
    pid: int
    fd: int
    deadline: float
    answer: bytes = b""


def main() -> int:
    from halfmoon.cluster.frontend.grammar_checks import build_here

    # xgrammar and what a build uses, loaded and run once before "ready": every child shares
    # them instead of loading them within a request's deadline.
    build_here([(FIELD, StructuredOutput("json", '{"type": "object"}'))])
    _write({"ready": True})
    selector = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()
    selector.register(stdin, selectors.EVENT_READ)
    pending, children = b"", {}
    while True:
        wait = min((c.deadline for c in children.values()), default=None)
        timeout = None if wait is None else max(0.0, wait - time.monotonic())
        for key, _ in selector.select(timeout):
            if key.fd == stdin:
                data = os.read(stdin, 1 << 20)
                if not data:
                    _stop(children)
                    return 0
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    child = _start(json.loads(line))
                    children[child.fd] = child
                    selector.register(child.fd, selectors.EVENT_READ)
            else:
                child = children[key.fd]
                data = os.read(key.fd, 1 << 16)
                child.answer += data
                if not data:
                    selector.unregister(key.fd)
                    _finish(children.pop(key.fd))
        now = time.monotonic()
        for fd in [fd for fd, child in children.items() if child.deadline <= now]:
            selector.unregister(fd)
            _kill(children.pop(fd))


def _start(request: dict) -> _Child:
    read_end, write_end = os.pipe()
    structured = StructuredOutput(str(request["kind"]), str(request["spec"]))
    pid = os.fork()
    if pid == 0:  # the child: build, write the answer, exit without any cleanup of the parent's
        os.close(read_end)
        os._exit(_build_in_child(structured, write_end))
    os.close(write_end)
    deadline = time.monotonic() + float(request["timeout_s"])
    return _Child(int(request["id"]), pid, read_end, deadline)


def _build_in_child(structured: StructuredOutput, out: int) -> int:
    from halfmoon.cluster.frontend.grammar_checks import build_here

    try:
        limit = _data_bytes() + CHILD_MEMORY_BYTES
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        build_here([(FIELD, structured)])
        error = None
    except InvalidRequestError as refused:
        error = refused.allowed
    except MemoryError:
        error = f"its grammar needs over {CHILD_MEMORY_BYTES >> 30} GiB to build"
    os.write(out, json.dumps({"error": error}).encode())
    return 0


def _data_bytes() -> int:
    """This process's data segment (what RLIMIT_DATA bounds), from /proc/self/status."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmData:"))
    return int(line.split()[1]) * 1024


def _finish(child: _Child) -> None:
    os.close(child.fd)
    os.waitpid(child.pid, 0)
    try:
        error = json.loads(child.answer)["error"]
    except ValueError:  # died without answering: a crash in the build (out of memory, ...)
        error = "its grammar could not be built (the build crashed)"
    _write({"id": child.request_id, "error": error})


def _kill(child: _Child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    os.waitpid(child.pid, 0)
    os.close(child.fd)
    _write({"id": child.request_id, "error": TIMEOUT})


def _stop(children: dict[int, _Child]) -> None:
    for child in children.values():
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)


def _write(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
