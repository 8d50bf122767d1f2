"""The Dockerfile builds on a base image given as an argument, installs the torch halfmoon pins,
copies only what exists, and runs `halfmoon serve` reachable through published ports."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_the_base_image_is_an_argument_declared_before_from():
    steps = instructions()
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert [args for op, args in steps if op == "FROM"] == ["${BASE_IMAGE}"]


def test_torch_is_the_version_pyproject_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [dep for dep in project["dependencies"] if dep.startswith("torch")]
    pinned = re.search(r"<=([\d.]+)", torch).group(1)
    assert ("ARG", f"TORCH_VERSION={pinned}") in instructions()


def test_copied_sources_exist_and_the_image_serves():
    steps = dict(reversed(instructions()))  # the first of each instruction
    copies = [args.split() for op, args in instructions() if op == "COPY"]
    assert copies and all((ROOT / source).exists() for *sources, _ in copies for source in sources)
    command = json.loads(steps["ENTRYPOINT"]) + json.loads(steps["CMD"])
    # Bound beyond loopback, so it serves only with $HALFMOON_API_KEY (never unauthenticated).
    assert command == ["halfmoon", "serve", "--host", "0.0.0.0"]
    assert "-e HALFMOON_API_KEY" in (ROOT / "Dockerfile").read_text()
    assert steps["EXPOSE"].split() == ["50051", "9400"]
    assert steps["USER"] == "halfmoon"


def test_the_build_context_leaves_out_local_state():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".whl", "tests"} <= set(ignored)
