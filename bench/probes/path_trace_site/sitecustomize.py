"""Run at start-up by every process of a traced cluster (`bench/probes/path_trace.py` puts this
folder first on PYTHONPATH): where $HALFMOON_PATH_TRACE_DIR is set, record per epoch the first
entry into each project file and write it to `$DIR/<pid>-<epoch>.jsonl` when the epoch ends."""

import contextlib
import os
import sys

POLL_S = 0.05
EXCLUDED = (".venv/", "tests/", "bench/")
_MISS = object()


def _chain() -> None:
    """Run the sitecustomize this one shadows: the next on sys.path. The venv's interpreter
    (pyenv 3.11) has none today; /usr/lib/python3.11's belongs to the system Python."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.realpath(os.path.dirname(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["_halfmoon_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


class _Tracer:
    """The profile hook and its per-epoch record; the hook does one dict lookup per call."""

    def __init__(self, out_dir: str, root: str) -> None:
        import threading
        import time

        self.out_dir, self.prefix = out_dir, root.rstrip("/") + "/"
        self.files: dict[str, str | None] = {}
        self.current: tuple[set, list] = (set(), [])
        self.epoch = self._read_epoch(0)
        self._threads, self._time = threading, time.time

    def project_path(self, filename: str) -> str | None:
        """`filename` relative to the repo root, or None outside the project."""
        if not filename.startswith(self.prefix):
            return None
        rel = filename[len(self.prefix) :]
        return None if rel.startswith(EXCLUDED) else rel

    def hook(self, frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        # Keyed by the filename string (its hash is cached); a code object's is recomputed.
        rel = self.files.get(code.co_filename, _MISS)
        if rel is _MISS:
            rel = self.files[code.co_filename] = self.project_path(code.co_filename)
        if rel is None:
            return
        seen, records = self.current
        if rel not in seen:
            seen.add(rel)
            records.append(self._record(rel, code.co_name))

    def _record(self, rel: str, function: str) -> tuple:
        thread = self._threads._active.get(self._threads.get_ident())
        name = thread.name if thread is not None else None
        return (self._time(), name, self._threads.get_native_id(), rel, function)

    def _read_epoch(self, default: int) -> int:
        try:
            with open(os.path.join(self.out_dir, "epoch")) as file:
                return int(file.read().strip())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return default

    def poll_forever(self) -> None:
        import time

        sys.setprofile(None)  # this thread's own calls are not the host's
        while True:
            time.sleep(POLL_S)
            with contextlib.suppress(Exception):  # never into the host process
                self.poll()

    def poll(self) -> None:
        """On a new epoch number: a fresh record, and the finished one written out."""
        epoch = self._read_epoch(self.epoch)
        if epoch == self.epoch:
            return
        finished, self.current = self.current, (set(), [])
        ended, self.epoch = self.epoch, epoch
        self.dump(ended, finished[1])

    def dump(self, epoch: int, records: list) -> None:
        import json

        pid, title = os.getpid(), _title()
        path = os.path.join(self.out_dir, f"{pid}-{epoch}.jsonl")
        lines = [json.dumps(_row(pid, title, record)) + "\n" for record in list(records)]
        with open(path + ".tmp", "w") as file:
            file.writelines(lines)
        os.replace(path + ".tmp", path)  # readers never see half a file

    def start(self) -> None:
        self.install()
        os.register_at_fork(after_in_child=self.after_fork)

    def install(self) -> None:
        sys.setprofile(self.hook)
        # Threads started outside `threading` (Ray's C++ ones) stay unhooked: 3.11 has no
        # setprofile_all_threads. Ray runs async actors' calls on a `threading` thread.
        self._threads.setprofile(self.hook)
        poller = self._threads.Thread(target=self.poll_forever, name="path-trace-poll")
        poller.daemon = True
        poller.start()

    def after_fork(self) -> None:
        """A forked child starts its own record (its parent's is the parent's to write)."""
        try:
            self.current = (set(), [])
            self.install()
        except Exception:  # noqa: BLE001 - never into the host process
            pass


def _row(pid: int, title: str, record: tuple) -> dict:
    at_s, name, native_id, rel, function = record
    thread = name if name is not None else f"native:{_native_name(native_id)}"
    return {"t": at_s, "pid": pid, "title": title, "thread": thread, "file": rel, "fn": function}


def _native_name(native_id: int) -> str:
    """The OS name of a thread Python did not start (Ray's own), while it still runs."""
    try:
        with open(f"/proc/self/task/{native_id}/comm") as file:
            return file.read().strip()
    except OSError:
        return str(native_id)


def _title() -> str:
    """This process's title: Ray sets an actor's to `ray::ClassName...`."""
    try:
        with open("/proc/self/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return " ".join(sys.argv)


def _install() -> None:
    out_dir = os.environ.get("HALFMOON_PATH_TRACE_DIR")
    root = os.environ.get("HALFMOON_PATH_TRACE_ROOT")
    if out_dir and root:
        _Tracer(out_dir, os.path.realpath(root)).start()


for _step in (_install, _chain):
    with contextlib.suppress(Exception):  # never into the host process
        _step()
