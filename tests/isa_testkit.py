"""The CPU kernels' variants this machine runs (`kernels/cpu_build.py`), as a fixture: each
kernel test runs once per variant, so an AVX-512 machine also tests what an AVX2 one runs. A
variant that does not build fails where there is a compiler (it is skipped, saying so, only
where there is none)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from halfmoon.kernels import cpu_build

RUNNABLE = tuple(isa.name for isa in cpu_build.runnable())
# The variants with vector kernels (all but `generic`).
VECTOR = tuple(name for name in RUNNABLE if name != "generic")


def require_built(library: cpu_build.Library) -> None:
    """Fail the test if `library` did not build for the current variant (skip it if there is
    no compiler at all: the torch references serve then, and this machine cannot tell)."""
    error = library.error()
    if error is None:
        return
    if not cpu_build.compiler_version():
        pytest.skip(error)
    pytest.fail(f"{library.source.name} ({cpu_build.current().name}): {error}")


@contextlib.contextmanager
def variant(name: str, *libraries: cpu_build.Library) -> Iterator[str]:
    """Inside: the kernels' `name` variant, each of `libraries` required to have built."""
    with cpu_build.use(name):
        for library in libraries:
            require_built(library)
        yield name
