"""`make bench-served-vllm`'s script parses and explains itself (its runs need vLLM from
`make peers` and ~15 minutes of a quiet machine: they are a benchmark, not a test)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "served-vs-vllm.sh"


def test_the_script_parses_and_its_help_names_its_settings():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    shown = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0
    for setting in ("RATES", "SERVERS", "ROUNDS", "PORT", "MODEL", "OUT", "make peers"):
        assert setting in shown.stdout
