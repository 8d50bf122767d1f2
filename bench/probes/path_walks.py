"""The files of one request's path: their folders, the model's step counted as one entry, and
docs/architecture.md's walks of the request read back and compared with a trace of it
(`halfmoon bench path-trace`)."""

from __future__ import annotations

import re
from pathlib import Path

from halfmoon.bench.probes.path_trace_serve import REPO_ROOT

THE_MODEL = "the model"
# The forward pass: the model, its runner, the layers and tensors it builds, and the kernels.
MODEL_PREFIXES = ("kernels/",)
MODEL_STEP = (
    ("model", "mlp", "moe_block", "model_runner", "rope", "cpu_linear", "cpu_memory"),
    ("step_inputs", "device_copy", "cuda_graphs", "cuda_events", "tensor_parallel"),
)
MODEL_FILES = frozenset(f"engine/{name}.py" for names in MODEL_STEP for name in names)


def folder_of(path: str) -> str:
    """The folder of a repo-relative file (`cluster/serving`, `engine`; `.` at the root)."""
    return str(Path(path).parent) if path != THE_MODEL else THE_MODEL


def collapse_model(path: str) -> str:
    """`the model` for a file of the model's step or a kernel; any other path as it is."""
    return THE_MODEL if path in MODEL_FILES or path.startswith(MODEL_PREFIXES) else path


def count_folder_changes(paths: list[str]) -> int:
    """How many adjacent entries of `paths` lie in different folders."""
    folders = [folder_of(path) for path in paths]
    return sum(1 for left, right in zip(folders, folders[1:], strict=False) if left != right)


# docs/architecture.md walks each API's request through its files, one numbered step a file (the
# model's files share one): "N. <file> (process, thread): what it does"; "(...; when ...)" marks a
# step that runs only then. The paragraph opening BACKGROUND_OPENING names the polls.
DOC = REPO_ROOT / "docs" / "architecture.md"
WALK_SECTION = "## One request, file by file"
WALK_HEADINGS = {"openai": "### OpenAI streaming chat (HTTP)", "grpc": "### gRPC Generate"}
BACKGROUND_OPENING = "In the background"


def doc_walks(text: str) -> dict:
    """docs/architecture.md's walks: per API its steps in order, each with the files it names
    before its parenthesis, that parenthesis, and whether it is conditional ("when ...");
    "background": the files named by the paragraph that opens "In the background" (polls)."""
    section = text.split(WALK_SECTION, 1)[1].split("\n## ", 1)[0]
    walks: dict = {}
    for api, heading in WALK_HEADINGS.items():
        body = (
            section.split(f"{heading}\n", 1)[1].split("\n### ", 1)[0] if heading in section else ""
        )
        steps = re.findall(r"^(\d+)\. (.*(?:\n {3,}\S.*)*)", body, flags=re.MULTILINE)
        walks[api] = [_step(int(number), " ".join(item.split())) for number, item in steps]
    background = [p for p in section.split("\n\n") if p.startswith(BACKGROUND_OPENING)]
    walks["background"] = sorted(set(re.findall(r"`([\w/]+\.py)`", "\n".join(background))))
    return walks


def _step(number: int, item: str) -> dict:
    head, _, rest = item.partition(" (")
    where = rest.split(")", 1)[0]
    files = re.findall(r"`([\w/]+\.py)`", head)
    return {"number": number, "files": files, "where": where, "when": "when " in f" {where}"}


def walk_gaps(report: dict, walks: dict) -> dict:
    """Where one API's walk and its trace disagree: request-only files (the model as one) the
    walk does not list (nor the background paragraph), listed files that do not exist, and
    listed files that did not run in the request window though not marked "when ..."."""
    steps = walks[report["api"]]
    listed = {collapse_model(file) for step in steps for file in step["files"]}
    ran = {entry["file"] for entry in report["request"]["entries"]}
    missing = [file for file in report["request_only"] if file not in listed]
    files = [(file, step) for step in steps for file in step["files"]]
    return {
        "missing": [file for file in missing if file not in walks["background"]],
        "gone": [file for file, _ in files if not (REPO_ROOT / file).is_file()],
        "not_run": [f for f, step in files if collapse_model(f) not in ran and not step["when"]],
    }


def walk_report_lines(reports: dict, walks: dict) -> list[str]:
    """What docs/architecture.md's walk of each measured API misses or lists in vain."""
    lines = []
    for api, report in reports.items():
        gaps = walk_gaps(report, walks)
        found = [f"{name}: {', '.join(files)}" for name, files in gaps.items() if files]
        verdict = "; ".join(found) if found else "matches this trace"
        lines.append(f"docs/architecture.md, {WALK_HEADINGS[api]!r}: {verdict}")
    return lines
