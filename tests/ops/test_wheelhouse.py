"""The offline wheelhouse (deploy/gpu/wheelhouse.py, `make wheelhouse` / `make install-wheelhouse`).

The rehearsal plays the GPU host on this machine: a fresh virtual environment that holds only
what the host's image holds (this environment's copies of the distributions named in
deploy/gpu/image-packages.txt), the wheelhouse built for this Python and installed there without
an index, and halfmoon served from it: Ray from the slimmed wheel, the gRPC CLI, the OpenAI API
through the `openai` SDK from the wheelhouse, and redis-server from the carried .debs.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from cache_testkit import cache_with_built_kernels
from serve_testkit import start_serve

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "gpu"))
import wheelhouse  # noqa: E402 - deploy/gpu is not a package

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
PACKAGES = ["engine", "kernels", "kvstore", "prefill_worker", "decode_worker", "router", "cluster"]
# The Triton kernels' tests and the engine tests that load checkpoints, configs, tokenizers and
# chat templates through transformers or compare with its models.
VERSION_SENSITIVE_TESTS = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/kernels").glob("test_triton_*.py")),
    *(
        f"tests/engine/test_{name}.py"
        for name in (
            "exactness",
            "model_config",
            "tokenizer_load",
            "detokenizer",
            "penalties",
            "bad_input",
        )
    ),
]


def test_plan_carries_what_the_device_image_lacks_at_this_checkouts_versions():
    image = wheelhouse.read_image(wheelhouse.DEFAULT_IMAGE)
    carried = {c.name: c for c in wheelhouse.plan("3.12", "x86_64", image)}
    # halfmoon's own requirements the image lacks, their dependencies, and the dev extra's
    # test clients; opentelemetry-api is fastapi's (the hand-kept list before missed it).
    assert {
        "ray",
        "redis",
        "pydantic",
        "pydantic-core",
        "grpcio-health-checking",
        "grpcio-reflection",
        "fastapi",
        "opentelemetry-api",
        "starlette",
        "uvicorn",
        "httpx2",
        "httpcore2",
        "openai",
        "jsonschema",
        "rpds-py",
    } <= set(carried)
    # Always carried, whatever the image holds: the stubs need this checkout's runtime, and
    # pydantic and Ray newer typing-extensions and packaging than an image may hold.
    assert {"grpcio", "protobuf", "typing-extensions", "packaging"} <= set(carried)
    assert not set(carried) & (image - wheelhouse.ALWAYS_CARRY)
    assert not set(carried) & set(wheelhouse.SKIP)
    # Nor the `transfer-*` extras: Mooncake's Transfer Engine wheel does not fit the carry.
    assert not [name for name in carried if name.startswith("mooncake")]
    for name, entry in carried.items():
        assert entry.version == metadata.version(name), name
        assert entry.spec == f"{name}=={entry.version}"


def test_plan_follows_the_targets_markers():
    """triton is required on Linux x86_64 only; with an empty image it is carried there only."""
    on_x86 = {c.name for c in wheelhouse.plan(HERE, "x86_64", set())}
    on_arm = {c.name for c in wheelhouse.plan(HERE, "aarch64", set())}
    assert "torch" in on_x86 and "torch" in on_arm
    assert "triton" in on_x86 and "triton" not in on_arm


def test_image_list_reads_names_comments_and_pins(tmp_path):
    image = tmp_path / "image.txt"
    image.write_text("# a comment\nTyping_Extensions==4.1\n\nprometheus-client  # why\nray>=2\n")
    assert wheelhouse.read_image(image) == {"typing-extensions", "prometheus-client", "ray"}


def test_slim_ray_drops_the_folders_and_keeps_a_matching_record(tmp_path):
    wheel = tmp_path / "ray-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        names = [
            "ray/__init__.py",
            "ray/jars/a.jar",
            "ray/rllib/x.py",
            "ray/dashboard/head.py",
            "ray/dashboard/client/i.js",
            "ray-1.0.dist-info/METADATA",
        ]
        for name in names:
            out.writestr(name, name)
        out.writestr("ray-1.0.dist-info/RECORD", "stale")
    wheelhouse.slim_ray(wheel)
    with zipfile.ZipFile(wheel) as slim:
        names = slim.namelist()
        record = slim.read("ray-1.0.dist-info/RECORD").decode().splitlines()
    kept = ["ray/__init__.py", "ray/dashboard/head.py", "ray-1.0.dist-info/METADATA"]
    assert sorted(names) == sorted([*kept, "ray-1.0.dist-info/RECORD"])
    assert sorted(row.split(",")[0] for row in record) == sorted(
        [*kept, "ray-1.0.dist-info/RECORD"]
    )


def _install(wheelhouse_dir: Path, prefix: Path, python: str = sys.executable):
    return subprocess.run(
        [
            python,
            str(ROOT / "deploy/gpu/wheelhouse.py"),
            "install",
            "--wheelhouse",
            str(wheelhouse_dir),
            "--prefix",
            str(prefix),
            "--print-env",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_install_refuses_a_wheelhouse_for_another_python_or_a_partial_copy(tmp_path):
    result = _install(tmp_path / "none", tmp_path / "prefix")
    assert result.returncode == 1 and "wheelhouse.json not found" in result.stderr
    other = "3.12" if HERE != "3.12" else "3.13"
    manifest = {"python_version": other, "arch": platform.machine(), "wheels": [], "debs": []}
    (tmp_path / "wheelhouse.json").write_text(json.dumps(manifest))
    result = _install(tmp_path, tmp_path / "prefix")
    assert result.returncode == 1
    assert f"is for Python {other}" in result.stderr and f"WHEEL_PYTHON={HERE}" in result.stderr
    manifest.update(python_version=HERE, wheels=["gone-1.0-py3-none-any.whl"])
    (tmp_path / "wheelhouse.json").write_text(json.dumps(manifest))
    result = _install(tmp_path, tmp_path / "prefix")
    assert result.returncode == 1 and "lacks gone-1.0-py3-none-any.whl" in result.stderr
    assert not (tmp_path / "prefix").exists()


def _image_only_python(where: Path) -> str:
    """A fresh venv's python that sees, of this environment, only the image's distributions."""
    image_dir = where / "image"
    image_dir.mkdir()
    for name in wheelhouse.read_image(wheelhouse.DEFAULT_IMAGE):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for top in {file.parts[0] for file in dist.files or [] if file.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (image_dir / top).exists():
                (image_dir / top).symlink_to(source)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "image.pth").write_text(f"{image_dir}\n")
    return str(venv / "bin" / "python")


def _ok(args: list[str], **kwargs) -> str:
    """Run `args` to success (its output is the failure message) and return its stdout."""
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _read_until(process: subprocess.Popen, needle: str, timeout_s: float) -> None:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if needle in line:
            return
        if process.poll() is not None:
            break
    raise AssertionError(f"no {needle!r} from halfmoon serve:\n{''.join(seen[-40:])}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rehearsal_halfmoon_serves_from_the_wheelhouse_on_an_image_only_python(
    tiny_model_dir, tmp_path
):
    from halfmoon.kvstore.redis_server import free_port

    python = _image_only_python(tmp_path)
    probe = [python, "-c", "import ray"]
    assert subprocess.run(probe, capture_output=True).returncode != 0, "ray leaked into the image"

    built = tmp_path / "whl"
    _ok(
        [
            sys.executable,
            str(ROOT / "deploy/gpu/wheelhouse.py"),
            "build",
            "--python-version",
            HERE,
            "--arch",
            platform.machine(),
            "--out",
            str(built),
        ],
        timeout=600,
    )
    manifest = json.loads((built / "wheelhouse.json").read_text())
    (ray_wheel,) = built.glob("ray-*.whl")
    with zipfile.ZipFile(ray_wheel) as ray_zip:
        assert not [n for n in ray_zip.namelist() if n.startswith(wheelhouse.RAY_DROP)]

    prefix = tmp_path / "offline"
    installed = _install(built, prefix, python)
    assert installed.returncode == 0, installed.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for line in installed.stdout.splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value.strip('"')
    cache = cache_with_built_kernels(tmp_path / "cache")
    env.update(RAY_ADDRESS="local", HALFMOON_CACHE=str(cache))
    assert str(prefix / "site") in env["PYTHONPATH"].split(os.pathsep)

    # Every module halfmoon ships imports from there.
    walk = (
        "import importlib, pkgutil, halfmoon;"
        f"names = [n for p in {PACKAGES!r} for n in [f'halfmoon.{{p}}'] + ["
        "m.name for m in pkgutil.walk_packages(importlib.import_module(f'halfmoon.{p}').__path__,"
        " f'halfmoon.{p}.')]];"
        "[importlib.import_module(n) for n in names]; print(len(names))"
    )
    assert int(_ok([python, "-c", walk], env=env)) > 100
    # The GPU suite's two parts (deploy/gpu/test-gpu.sh) collect there without an error (its
    # `-m gpu tests` read from the modules that mark any: collecting every module took 13 s).
    gpu_modules = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )
    for selection in (["-m", "not slow", "tests/kernels"], ["-m", "gpu", *gpu_modules]):
        collected = _ok(
            [python, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *selection],
            cwd=ROOT,
            env=env,
            timeout=300,
        )
        counted = re.search(r"(\d+)(/\d+)? tests? collected", collected)
        assert counted and int(counted.group(1)) > 0, collected[-3000:]

    if manifest["debs"]:  # redis-server runs from the unpacked .debs, not from this machine's
        redis = shutil.which("redis-server", path=env["PATH"])
        assert redis == str(prefix / "redis/usr/bin/redis-server")
        assert "Redis server" in _ok([redis, "--version"], env=env)

    port, metrics_port, http_port = free_port(), free_port(), free_port()
    serve = start_serve(
        tiny_model_dir,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--http-port",
        str(http_port),
        env=env,
        python=python,
    )
    try:
        _read_until(serve, "gRPC", timeout_s=240)
        out = _ok(
            [
                python,
                "-m",
                "halfmoon.cluster.cli",
                "generate",
                "--server",
                f"127.0.0.1:{port}",
                "--max-tokens",
                "5",
                "--json",
                "Hello",
            ],
            timeout=120,
            env=env,
        )
        assert len(json.loads(out)["token_ids"]) == 5
        chat = (
            "from openai import OpenAI;"
            f"client = OpenAI(base_url='http://127.0.0.1:{http_port}/v1', api_key='unused');"
            "model = client.models.list().data[0].id;"
            "reply = client.completions.create(model=model, prompt='Hello', max_tokens=4,"
            " extra_body={'ignore_eos': True});"  # sampled: an early EOS would end it short
            "print(reply.usage.completion_tokens)"
        )
        assert _ok([python, "-c", chat], env=env).strip() == "4"
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()


def _one_case_per_test(paths: list[str]) -> list[str]:
    """The first parametrization of each test function in `paths`: a version gap breaks an API
    the test calls, whatever its shapes, and every case runs in the main suite anyway."""
    listed = _ok(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "-m",
            "not slow",
            *paths,
        ],
        cwd=ROOT,
        timeout=300,
    )
    firsts: dict[str, str] = {}
    for line in listed.splitlines():
        if "::" in line and not line.startswith(" "):
            firsts.setdefault(line.split("[")[0], line)
    return list(firsts.values())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_kernel_and_engine_tests_pass_on_the_gpu_images_versions():
    """deploy/gpu/rehearse-image.sh: Triton 3.6 (interpreted) and transformers 5.17 here, on
    one case of each test that uses them directly (`make rehearse-image` runs every kernel and
    engine test). The overlay is kept in the halfmoon cache, rebuilt when the pins change."""
    from halfmoon.engine.init_model import default_model_dir

    overlay = default_model_dir().parent / "image-overlay"
    env = {**os.environ, "REHEARSAL_DIR": str(overlay), "PY": sys.executable}
    env["REHEARSAL_TESTS"] = " ".join(_one_case_per_test(VERSION_SENSITIVE_TESTS))
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", str(ROOT / "deploy/gpu/rehearse-image.sh"), "-x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    pins = dict(
        line.split("==")
        for line in (ROOT / "deploy/gpu/image-versions.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    versions = f"triton {pins['triton']} transformers {pins['transformers']}"
    assert f"rehearse-image: {versions}" in result.stdout
    assert re.search(r"\d+ passed", result.stdout) and " failed" not in result.stdout


def test_a_wheelhouse_past_the_carry_limit_fails_its_build_with_the_sizes():
    tree = wheelhouse.tracked_bytes()
    assert 0 < tree < 16 << 20  # the checkout's tracked files, as a device call copies them
    assert wheelhouse.carry_problem(50 << 20, tree) is None
    problem = wheelhouse.carry_problem(61 << 20, 3 << 20)
    assert "61.0 MiB" in problem and "3.0 MiB" in problem and "64.0 MiB" in problem
    assert "past the 62 MiB" in problem
