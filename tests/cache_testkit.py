"""A fresh `HALFMOON_CACHE` for a process under test that shares only the built C++ kernels."""

from __future__ import annotations

from pathlib import Path

from halfmoon.kernels import cpu_build


def cache_with_built_kernels(root: Path) -> Path:
    """`root`, made an empty halfmoon cache whose `kernels` folder is this session's: a process
    that finds no built kernel compiles them (~8 s of g++ in each worker), and the build is
    keyed by source, flags and CPU, so sharing it changes nothing else."""
    shared = cpu_build.cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(shared, target_is_directory=True)
    return root
