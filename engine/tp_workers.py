"""Ranks 1..T-1 of a tensor-parallel engine, each in a process of its own, driven by rank 0 (the
engine's process) through a pipe: allocate the KV pages, run a step, stop.

A step's inputs and activations move through the process group (tensor_parallel.py); the pipe
only wakes a rank for a step, so an idle engine keeps its ranks waiting with no collective
timing out, and a rank whose engine is gone sees the pipe close and exits. The ranks are plain
subprocesses, not `multiprocessing`'s spawn, which would re-run a script's unguarded top level."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from halfmoon.engine.errors import RankFailedError
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.tensor_parallel import connect, joined_store, listening_store, rank_devices

log = logging.getLogger(__name__)
STEP, STOP, STARTED, READY = "step", "stop", "started", "ready"
STOP_WAIT_S = 5.0
ENTRY = "import sys; from halfmoon.engine.tp_workers import rank_main; rank_main(int(sys.argv[1]))"


class RankWorkers:
    """Rank 0's handle on the processes of ranks 1..T-1, which load their slices of the model
    while rank 0 loads its own."""

    def __init__(
        self, model_dir: Path, block_size: int, dtype: torch.dtype, device: torch.device, size: int
    ) -> None:
        devices = rank_devices(device, size)
        self.store = listening_store(size)
        threads, self.threads_before = max(1, torch.get_num_threads() // size), None
        if device.type == "cpu":  # the ranks share the cores: more threads only contend
            self.threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            ours, theirs = Pipe()
            command = [sys.executable, "-c", ENTRY, str(theirs.fileno())]
            self.procs.append(subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env))
            theirs.close()
            place = (rank, size, self.store.port, devices[rank], threads)
            ours.send((*place, str(model_dir), block_size, dtype))
            self.conns.append(ours)
        self.failed: RankFailedError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.threads_before)
        try:
            self._expect(STARTED, "starting")
            self.group = connect(0, size, self.store, devices[0])
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def allocate(
        self, num_pages: int, max_model_len: int, kv_dtype: torch.dtype
    ) -> list[str | None]:
        """Every other rank allocates its KV pages (its KV heads, in `kv_dtype`) and its rotary
        table; returns the memory file each rank's pages are in (None where it cannot share)."""
        with contextlib.suppress(OSError):  # a dead rank is reported by `_expect`
            for conn in self.conns:
                conn.send(("kv", num_pages, max_model_len, kv_dtype))
        return self._expect(READY, "loading the model")

    def guard(self, step, *args):
        """`step(*args)` (which calls `wake`), failing with a RankFailedError if a rank died;
        after one the engine cannot step again."""
        if self.failed is not None:
            raise self.failed
        try:
            return step(*args)
        except (RuntimeError, OSError) as error:
            self.failed = self._failure("in a step")
            self.close()
            raise self.failed from error
        except Exception as error:  # a KV hook's: the other ranks are left mid-step
            self.failed = RankFailedError(
                f"tensor-parallel rank 0 failed in a step ({error!r}), leaving the other ranks "
                "mid-step; it cannot continue: create it again"
            )
            self.close()
            raise self.failed from error

    def check(self) -> None:
        """Raise a RankFailedError if a step failed or a rank has exited since; reads state
        only, so any thread may ask (a worker's health check) while a step runs."""
        if self.failed is not None:
            raise self.failed
        if dead := self._exited():
            raise RankFailedError(
                f"tensor-parallel engine cannot step: {'; '.join(dead)}; create it again"
            )

    def wake(self) -> None:
        """The other ranks join the step rank 0 is about to broadcast."""
        for conn in self.conns:
            conn.send(STEP)

    def close(self) -> None:
        """Stop the other ranks (at once if they are waiting for a step)."""
        self._finalizer()

    def _expect(self, message: str, doing: str) -> list:
        """Wait for `message` (or `(message, payload)`) from every other rank and return the
        payloads; if one fails instead, stop them all."""
        payloads = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), 1):
            while not conn.poll(0.1) and proc.poll() is None:
                pass
            try:
                got = conn.recv()
            except (EOFError, OSError):  # it exited with nothing to say
                got = None
            if isinstance(got, tuple) and got[0] == message:
                payloads.append(got[1])
                continue
            if got == message:
                payloads.append(None)
                continue
            error = (
                self._failure(f"while {doing}")
                if got is None
                else RankFailedError(f"tensor-parallel rank {rank} failed while {doing}:\n{got}")
            )
            self.close()
            raise error
        return payloads

    def _failure(self, what: str) -> RankFailedError:
        deadline = time.monotonic() + 1.0  # a rank whose connection just closed is exiting
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        dead = self._exited(_last_words)
        return RankFailedError(
            f"tensor-parallel engine failed {what}: {'; '.join(dead) or 'every rank is alive'}; "
            "it cannot continue: create it again"
        )

    def _exited(self, last_words: Callable[[Connection], str] = lambda _: "") -> list[str]:
        """One line for each other rank whose process has exited."""
        return [
            f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}{last_words(conn)}"
            for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1)
            if proc.poll() is not None
        ]


def _last_words(conn: Connection) -> str:
    """The traceback a failed rank sent before it exited, if any."""
    with contextlib.suppress(EOFError, OSError):
        if conn.poll(0):
            return f" after:\n{conn.recv()}"
    return ""


def _stop(procs: list[subprocess.Popen], conns: list[Connection], threads: int | None) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(STOP)
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
    if threads is not None:
        torch.set_num_threads(threads)


def rank_main(fd: int) -> None:
    """A rank's process: load its slice, allocate its pages, then run each step rank 0 wakes it
    for, until told to stop or rank 0 is gone."""
    # The runner imports this module to start the ranks; the ranks import the runner.
    from halfmoon.engine.model_runner import ModelRunner

    conn = Connection(fd)
    rank, size, port, device, threads, model_dir, block_size, dtype = conn.recv()
    try:
        torch.set_num_threads(threads)
        conn.send(STARTED)
        store = joined_store(port, size)
        group = connect(rank, size, store, device)
        cfg = load_model_config(model_dir)
        runner = ModelRunner(Path(model_dir), cfg, block_size, dtype, device, group)
        _, num_pages, max_model_len, kv_dtype = conn.recv()
        # In a memory file rank 0 maps: it reads and writes these pages itself (kv_shards.py).
        pages = runner.allocate_pages(num_pages, max_model_len, shared=True, kv_dtype=kv_dtype)
        conn.send((READY, pages))
        while conn.recv() == STEP:
            runner.follow()
    except EOFError:  # rank 0's process is gone
        return
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(traceback.format_exc())
        raise SystemExit(1) from None
