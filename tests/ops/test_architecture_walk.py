"""docs/architecture.md walks one streaming request through its source files, in order: the
list stays short, names files that exist, and follows the imports (each file is reached from
the files before it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 15
WALK_HEADING = "## One request, file by file"


def walk_files() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(WALK_HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.MULTILINE)


def module_of(path: str) -> str:
    return "halfmoon." + path.removesuffix(".py").replace("/", ".")


def imported_modules(path: str) -> set[str]:
    """Modules `path` imports, as dotted names (a `from x import y` counts x and x.y)."""
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_walk_is_short_and_names_real_files():
    files = walk_files()
    assert 5 <= len(files) <= MAX_FILES, files
    assert len(set(files)) == len(files), "a file is listed twice"
    for path in files:
        assert (ROOT / path).is_file(), f"docs/architecture.md lists {path}, which does not exist"


def test_each_file_is_reached_from_the_ones_before_it():
    """Each listed file imports, or is imported by, a file listed before it: a reader following
    the list never jumps to a file the code does not lead to."""
    files = walk_files()
    modules = {path: module_of(path) for path in files}
    imports = {path: imported_modules(path) for path in files}
    for index, path in enumerate(files[1:], start=1):
        earlier = files[:index]
        linked = any(
            modules[path] in imports[other] or modules[other] in imports[path] for other in earlier
        )
        assert linked, f"{path} (step {index + 1}) is not linked by imports to the steps before it"
