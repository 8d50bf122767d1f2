"""The house's size limits (issues 29 and 47): no source file over 400 lines, no class over 250, and
no `# fmt: skip` packing outside tables of constants."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = [
    "engine",
    "kernels",
    "kvstore",
    "prefill_worker",
    "decode_worker",
    "router",
    "cluster",
    "bench",
]
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250
# Tables of constants that read best as rows: histogram buckets, the metric table, the
# per-architecture config defaults.
TABULAR = {"cluster/control/metrics.py", "cluster/worker/metrics.py", "engine/model_config.py"}


def _sources() -> list[Path]:
    files = [path for part in PARTS for path in (ROOT / part).rglob("*.py")]
    return [path for path in files if "_pb2" not in path.name]  # generated gRPC stubs


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := _lines(p)) > MAX_FILE_LINES}
    assert long == {}


def test_no_class_is_over_250_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = size
    assert long == {}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_fmt_skip_outside_tables():
    packed = {
        str(path.relative_to(ROOT))
        for path in _sources()
        if "# fmt: skip" in path.read_text() and str(path.relative_to(ROOT)) not in TABULAR
    }
    assert packed == set()
