"""The parts import one way (DESIGN.md, "Layout"): the engine and the kernels know nothing of Ray
or of the parts above them; the store and the router know nothing of the workers, the cluster
or the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABOVE = {
    "engine": {"ray", "halfmoon.cluster", "halfmoon.prefill_worker", "halfmoon.decode_worker"},
    "kernels": {"ray", "halfmoon.engine", "halfmoon.cluster", "halfmoon.kvstore"},
    "kvstore": {"halfmoon.cluster", "halfmoon.prefill_worker", "halfmoon.decode_worker"},
    "router": {"ray", "halfmoon.cluster", "halfmoon.prefill_worker", "halfmoon.decode_worker"},
}
EVERY_PART_BELOW_BENCH = {"halfmoon.bench"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def reaches(name: str, forbidden: set[str]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in forbidden)


@pytest.mark.parametrize("part", sorted(ABOVE))
def test_a_part_imports_nothing_above_it(part):
    forbidden = ABOVE[part] | EVERY_PART_BELOW_BENCH
    found = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / part).rglob("*.py")
        for name in imports(path)
        if reaches(name, forbidden)
    }
    assert found == set()
