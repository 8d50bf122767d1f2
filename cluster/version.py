"""halfmoon's version, also where it runs from a checkout that was never pip-installed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("halfmoon")
    except PackageNotFoundError:
        return "0+checkout"
