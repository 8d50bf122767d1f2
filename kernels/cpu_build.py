"""Builds and loads the C++ CPU kernels (`cpu_*.cpp`) with the system's g++.

Each source is compiled on first use (`-O3 -march=native -fopenmp`, under a second), cached
under `$HALFMOON_CACHE/kernels` by a hash of its source, headers, flags and CPU, and loaded with
ctypes; its OpenMP runtime is torch's own libgomp (same soname, already loaded). Without a
compiler, or if a build fails (with a warning), `load` returns None and the torch references
serve instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path

FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=gnu++17",
]
_lock = threading.Lock()


@cache
def load(source: Path) -> ctypes.CDLL | None:
    """The shared library built from `source` (a path beside this file), or None."""
    with _lock:
        path = _build(source)
    return None if path is None else ctypes.CDLL(str(path))


def load_functions(source: Path, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """`load(source)` with the ctypes signature (argument types, result type) of each named
    function declared; None where it does not build."""
    library = load(source)
    if library is not None:
        for name, (argtypes, restype) in signatures.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, restype
    return library


def _build(source: Path) -> Path | None:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None or not source.is_file():  # no compiler, or an install without sources
        return None
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("cpu_*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode() + _cpu_flags())
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            warnings.warn(
                f"building {source.name} failed; the torch references serve instead:\n"
                f"{result.stderr[-2000:]}",
                stacklevel=3,
            )
            return None
        os.replace(built, target)  # atomic: another process may build the same file at once
    return target


def cache_dir() -> Path:
    """`$HALFMOON_CACHE/kernels`, by default `~/.cache/halfmoon/kernels` (beside the models)."""
    root = os.environ.get("HALFMOON_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "halfmoon"
    )
    return Path(root) / "kernels"


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in text.splitlines() if line.startswith("flags")), "").encode()
