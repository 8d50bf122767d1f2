"""Builds and loads the C++ CPU kernels (`cpu_*.cpp`) with the system's g++, one variant per
instruction set, and picks the variant this CPU runs best.

The variants (`ISAS`, best first): `amx` (AVX-512 with BF16 and AMX tiles: Sapphire Rapids and
later), `avx512bf16` (AVX-512 with BF16: Zen 4, Cooper Lake), `avx512` (x86-64-v4: Skylake-SP,
Ice Lake), `avx2` (x86-64-v3, AVX2 and FMA: Haswell, Zen 1-3) and `generic` (the plain loops,
on any CPU and architecture). Each is compiled for its own instruction set (`-march=...`, not
`-march=native`), so a build never uses an instruction the variant's CPUs lack, and the tests
build and run every variant the machine can execute (an AVX2 build runs on an AVX-512 CPU).
`HALFMOON_CPU_ISA=<name>` picks a lower one than the CPU's best (to measure what an older CPU
runs); one the CPU cannot run is refused.

A build takes seconds, once: it is cached under `$HALFMOON_CACHE/kernels` by a hash of the
source, headers, flags, compiler version and CPU, and loaded with ctypes; its OpenMP runtime is
torch's own libgomp (same soname, already loaded). Without a compiler, or if a build fails
(with a warning), a kernel module's library is None and the torch references serve instead;
`report()` says which variant each kernel took and why any did not build. The cache directory
must be the user's own and not writable by others, and a cached library another user wrote is
refused (rebuilt), so no one else's code is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ISA_ENV = "HALFMOON_CPU_ISA"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu++17")


@dataclass(frozen=True, slots=True)
class Isa:
    """One build variant: its g++ flags and the /proc/cpuinfo flags a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_WIDE = ("-mtune=native", "-mprefer-vector-width=512")
ISAS = (
    Isa(
        "amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", *_WIDE),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    ),
    Isa("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", *_WIDE), _V4 | {"avx512_bf16"}),
    Isa("avx512", ("-march=x86-64-v4", *_WIDE), _V4),
    Isa("avx2", ("-march=x86-64-v3", "-mtune=native"), _V3),
    Isa("generic", (), frozenset()),
)
BY_NAME = {isa.name: isa for isa in ISAS}
_lock = threading.Lock()
_chosen: list[Isa] = []  # the variant in use: chosen once, switched by `use` (tests, benches)


def runnable() -> tuple[Isa, ...]:
    """The variants this machine's CPU can run, best first (`generic` always)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return (BY_NAME["generic"],)
    flags = _cpu_flags()
    return tuple(isa for isa in ISAS if isa.needs <= flags)


def current() -> Isa:
    """The variant the kernels load: `$HALFMOON_CPU_ISA`, else the CPU's best."""
    if not _chosen:
        _chosen.append(_from_environment())
    return _chosen[0]


@contextlib.contextmanager
def use(name: str) -> Iterator[Isa]:
    """Load the kernels' `name` variant inside the block (for tests and benchmarks)."""
    isa = _checked(name)
    previous = current()
    _chosen[0] = isa
    try:
        yield isa
    finally:
        _chosen[0] = previous


def _from_environment() -> Isa:
    name = os.environ.get(ISA_ENV, "").strip().lower()
    return _checked(name) if name else runnable()[0]


def _checked(name: str) -> Isa:
    if name not in BY_NAME:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of {', '.join(BY_NAME)}")
    if BY_NAME[name] not in runnable():
        here = ", ".join(isa.name for isa in runnable())
        raise ValueError(f"{ISA_ENV}={name!r}: this CPU cannot run it (it runs {here})")
    return BY_NAME[name]


class Library:
    """A kernel source's shared library for the current variant, built on first use; `get()`
    is None where it does not build (`error(isa)` says why)."""

    def __init__(self, source: str, signatures: dict[str, tuple[list, object]]) -> None:
        self.source = Path(__file__).with_name(source)
        self.signatures = signatures
        self._loaded: dict[str, ctypes.CDLL | None] = {}
        self._errors: dict[str, str] = {}
        self._ready: dict[tuple[str, str], bool] = {}
        _LIBRARIES.append(self)

    def get(self) -> ctypes.CDLL | None:
        isa = current()
        if isa.name not in self._loaded:
            self._load(isa)
        return self._loaded[isa.name]

    def ready(self, check: str) -> bool:
        """Whether the library loads and its exported `check()` (e.g. `amx_ready`) answers 1
        on this CPU; asked once per variant."""
        isa = current().name
        if (isa, check) not in self._ready:
            library = self.get()
            self._ready[isa, check] = library is not None and getattr(library, check)() == 1
        return self._ready[isa, check]

    def error(self, isa: Isa | None = None) -> str | None:
        """Why the variant (the current one by default) did not build; None if it did."""
        isa = isa or current()
        if isa.name not in self._loaded:
            self._load(isa)
        return self._errors.get(isa.name)

    def _load(self, isa: Isa) -> None:
        with _lock:
            if isa.name in self._loaded:
                return
            path, error = _build(self.source, isa)
            library = None if path is None else ctypes.CDLL(str(path))
            for name, (argtypes, restype) in self.signatures.items() if library else ():
                function = getattr(library, name)
                function.argtypes, function.restype = argtypes, restype
            if error is not None:
                self._errors[isa.name] = error
            self._loaded[isa.name] = library


_LIBRARIES: list[Library] = []


def pointers(*tensors: torch.Tensor | None) -> list[int | None]:
    """The tensors' data pointers, as the kernels take them (None: a null pointer)."""
    return [None if t is None else t.data_ptr() for t in tensors]


def report() -> dict:
    """Which variant the kernels use and, per kernel, whether it built (for `status` and the
    benchmarks' JSON)."""
    isa = current()
    kernels = {lib.source.stem: lib.error(isa) or "built" for lib in _LIBRARIES}
    return {"isa": isa.name, "compiler": compiler_version(), "kernels": kernels}


def _build(source: Path, isa: Isa) -> tuple[Path | None, str | None]:
    """(the built library, None), or (None, why not)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None, "no C++ compiler (g++ or $CXX)"
    if not source.is_file():
        return None, f"{source.name} is not installed"
    flags = (*COMMON_FLAGS, *isa.flags)
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("cpu_*.h")))
    identity = [source.read_bytes(), headers, " ".join(flags).encode(), compiler_version().encode()]
    key = hashlib.sha256(b"\0".join([*identity, _cpu_identity()])).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"{source.stem}-{isa.name}-{key}.so"
    if target.is_file() and _owned(target):
        return target, None
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _owned(directory):
        return None, f"{directory} is another user's or writable by others: not loading from it"
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, str(source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            warnings.warn(
                f"building {source.name} for {isa.name} failed; the torch references serve "
                f"instead:\n{result.stderr[-2000:]}",
                stacklevel=4,
            )
            return None, f"the {isa.name} build failed: {result.stderr[-500:]}"
        os.replace(built, target)  # atomic: another process may build the same file at once
    return target, None


def _owned(path: Path) -> bool:
    """Whether `path` is this user's and no one else may write it."""
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def cache_dir() -> Path:
    """`$HALFMOON_CACHE/kernels`, by default `~/.cache/halfmoon/kernels` (beside the models)."""
    root = os.environ.get("HALFMOON_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "halfmoon"
    )
    return Path(root) / "kernels"


@cache
def compiler_version() -> str:
    """The compiler's first `--version` line ('' without one): part of every build's key."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return ""
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return result.stdout.splitlines()[0] if result.stdout else ""


@cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them; without /proc/cpuinfo, torch's reading of
    the CPU (AVX2 or AVX-512 at most)."""
    line = next((s for s in _cpuinfo().splitlines() if s.startswith("flags")), "")
    if line:
        return frozenset(line.partition(":")[2].split())
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": _V4, "AVX2": _V3}.get(capability, frozenset())


def _cpu_identity() -> bytes:
    """The CPU's model and flags: `-mtune=native` tunes a build for it."""
    lines = _cpuinfo().splitlines()
    wanted = ("model name", "flags")
    return "\n".join(next((s for s in lines if s.startswith(w)), "") for w in wanted).encode()


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
