"""`halfmoon serve` in a process of its own, as a user starts it, for the tests that watch its
output and its exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_serve(
    model_dir: Path, *args: str, env: dict, python: str = sys.executable, faulthandler: bool = False
) -> subprocess.Popen:
    """`python -m halfmoon.cluster.cli serve --model MODEL_DIR ARGS...`, its stdout and stderr
    merged into one text pipe."""
    flags = ["-X", "faulthandler"] if faulthandler else []
    command = [python, *flags, "-m", "halfmoon.cluster.cli", "serve", "--model", str(model_dir)]
    return subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
