"""docs/architecture.md walks the OpenAI and the gRPC request through every file that runs for
it, in order: each walk names files that exist, each once, and follows the imports (each file
is imported by a file listed before it or by an entry point, where a process starts: the HTTP
server, the gRPC server, a Ray actor's class). That the walks list every file that runs, and
only those, `tests/cluster/test_path_trace.py` checks against a trace of a real request."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from halfmoon.bench.probes.path_walks import DOC, WALK_HEADINGS, collapse_model, doc_walks

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = (
    "cluster",
    "decode_worker",
    "engine",
    "kernels",
    "kvstore",
    "prefill_worker",
    "router",
)
SERVERS = ("cluster/frontend/http_server.py", "cluster/frontend/grpc_server.py")


def walks() -> dict:
    return doc_walks(DOC.read_text())


def module_of(path: str) -> str:
    return "halfmoon." + path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@cache
def imported_modules(path: str) -> frozenset[str]:
    """Modules `path` imports, as dotted names (a `from x import y` counts x and x.y)."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


@cache
def source_files() -> tuple[str, ...]:
    return tuple(
        sorted(
            str(path.relative_to(ROOT))
            for folder in SOURCE_DIRS
            for path in (ROOT / folder).rglob("*.py")
        )
    )


def actor_classes(tree: ast.Module) -> set[str]:
    """The classes a module starts as Ray actors: `ray.remote(Cls)`, or a dict of them."""
    tables = {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names = set()
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if not (isinstance(func, ast.Attribute) and func.attr == "remote" and node.args):
            continue
        if not (isinstance(func.value, ast.Name) and func.value.id == "ray"):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Name):
            names.add(arg.id)
        elif isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):
            table = tables.get(arg.value.id)
            names.update(v.id for v in getattr(table, "values", []) if isinstance(v, ast.Name))
    return names


@cache
def entry_points() -> frozenset[str]:
    """Where a request's code starts in a process: the servers and each Ray actor's module."""
    trees = {path: ast.parse((ROOT / path).read_text()) for path in source_files()}
    started = set().union(*map(actor_classes, trees.values()))
    defines = {
        path
        for path, tree in trees.items()
        if any(isinstance(node, ast.ClassDef) and node.name in started for node in tree.body)
    }
    return frozenset(defines | set(SERVERS))


def test_the_actor_modules_are_found_in_the_code():
    assert {
        "cluster/serving/router_actor.py",
        "prefill_worker/worker.py",
        "decode_worker/worker.py",
    } <= entry_points()


@pytest.mark.parametrize("api", WALK_HEADINGS)
def test_each_walk_names_real_files_once_each(api):
    steps = walks()[api]
    assert len(steps) >= 10, f"{WALK_HEADINGS[api]}: {len(steps)} steps"
    assert [step["number"] for step in steps] == list(range(1, len(steps) + 1))
    files = [file for step in steps for file in step["files"]]
    assert all(step["files"] for step in steps), "a step names no file"
    assert len(set(files)) == len(files), (
        f"listed twice: {sorted(f for f in set(files) if files.count(f) > 1)}"
    )
    for path in files:
        assert (ROOT / path).is_file(), f"docs/architecture.md lists {path}, which does not exist"
    for step in steps:
        assert step["where"], f"step {step['number']} names no process and thread"
        if len(step["files"]) > 1:  # only the model's files share a step
            assert {collapse_model(f) for f in step["files"]} == {"the model"}, step


def test_the_background_paragraph_names_real_files():
    """The polls the walks leave out, named where the slow trace test allows them."""
    background = walks()["background"]
    assert background, "no paragraph opening 'In the background' names the polls"
    for path in background:
        assert (ROOT / path).is_file(), f"the background paragraph names {path}: no such file"


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Each source file's project imports, as files."""
    by_module = {module_of(path): path for path in source_files()}
    return {
        path: frozenset(by_module[name] for name in imported_modules(path) if name in by_module)
        for path in source_files()
    }


def reached(target: str, sources: set[str], listed: set[str]) -> bool:
    """Whether an import chain leads from one of `sources` to `target` through files the walk
    does not list (a package `__init__`, a registry: files that ran nothing for the request)."""
    seen, todo = set(sources), list(sources)
    while todo:
        for path in import_graph().get(todo.pop(), ()):
            if path == target:
                return True
            if path not in seen and path not in listed:
                seen.add(path)
                todo.append(path)
    return False


@pytest.mark.parametrize("api", WALK_HEADINGS)
def test_each_file_is_reached_from_the_ones_before_it(api):
    """Each listed file is imported by a file listed before it (in an earlier step, or earlier
    in the model's step) or by an entry point, directly or through files the walk does not
    list; or is an entry point: a reader following the walk never jumps to a file the code
    does not lead to."""
    files = [file for step in walks()[api] for file in step["files"]]
    for index, path in enumerate(files):
        sources = {*files[:index], *entry_points()}
        linked = path in entry_points() or reached(path, sources, set(files))
        assert linked, (
            f"{path} (file {index + 1} of {WALK_HEADINGS[api]!r}) is imported by none of the files "
            "before it nor by an entry point"
        )


def test_the_walk_parser_reads_steps_files_and_conditions():
    text = """## One request, file by file

Intro naming `bench/probes/path_trace.py`.

### OpenAI streaming chat (HTTP)

1. `cluster/frontend/http_server.py` (RouterActor, MainThread): takes the
   request (`http_stream.py` streams it).
2. The model: `engine/model.py`, `kernels/ops.py`
   (DecodeWorker, engine-step): the forward pass.

### gRPC Generate

1. `router/refit.py` (RouterActor, refit; when a refit is due): refits.

In the background: `cluster/serving/router_actor.py` polls.

## Next
"""
    found = doc_walks(text)
    openai, grpc = found["openai"], found["grpc"]
    assert [step["files"] for step in openai] == [
        ["cluster/frontend/http_server.py"],
        ["engine/model.py", "kernels/ops.py"],
    ]
    assert openai[1]["where"] == "DecodeWorker, engine-step" and not openai[1]["when"]
    assert grpc[0]["when"] and grpc[0]["files"] == ["router/refit.py"]
    assert found["background"] == ["cluster/serving/router_actor.py"]
