"""The built wheel works on its own: installed apart from the checkout, `halfmoon --help` and
`halfmoon init-model` run, and the files read at run time are inside the installed package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cache_testkit import cache_with_built_kernels

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(
    ".git", ".venv", ".whl", "build", "*.egg-info", "__pycache__", ".*_cache", "tests"
)
PACKAGE_DATA = [
    "cluster/api/halfmoon.proto",
    "deploy/profiles/cpu-tiny.yaml",
    "deploy/profiles/llama70b-8xh100.yaml",
    "deploy/configs/local.yaml",
    "deploy/configs/gpu-cluster.yaml",
    "deploy/autoscaling/slo-planner.yaml",
    "bench/studies/router_report_template.md",
    "kernels/cpu_attention.cpp",
    "kernels/cpu_elementwise.cpp",
    "kernels/cpu_prefill.cpp",
    "kernels/cpu_gemm.cpp",
    "kernels/cpu_common.h",
    "kernels/cpu_amx.h",
]


def run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """The wheel built from a copy of the checkout and installed (without its dependencies,
    which the test venv has) into a folder of its own; returns it and the env that imports it."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=SKIP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), "."],
        env,
        source,
    )
    (wheel,) = (tmp / "dist").glob("halfmoon-*.whl")
    target = tmp / "site"
    run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], env, tmp)
    cache = cache_with_built_kernels(tmp / "cache")
    return target, {**env, "PYTHONPATH": str(target), "HALFMOON_CACHE": str(cache)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_installed_package_holds_the_files_it_reads_at_run_time(installed):
    target, env = installed
    assert [p for p in PACKAGE_DATA if not (target / "halfmoon" / p).is_file()] == []
    license_files = list(target.glob("halfmoon-*.dist-info/licenses/LICENSE"))
    assert license_files and "Apache License" in license_files[0].read_text()
    probe = (
        "import halfmoon.cluster.cli as cli;"
        "from halfmoon.cluster.config import load_config;"
        "from pathlib import Path;"
        "root = Path(cli.__file__).parents[1];"
        "config = load_config(root / 'deploy/configs/local.yaml', {'router.profile': 'cpu-tiny'});"
        "print(root); print(config.router.profile)"
    )
    lines = run([sys.executable, "-c", probe], env, target.parent).stdout.split()
    package = target.resolve() / "halfmoon"
    assert lines == [str(package), str(package / "deploy" / "profiles" / "cpu-tiny.yaml")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_installed_console_script_runs_help_and_init_model(installed):
    target, env = installed
    script = str(target / "bin" / "halfmoon")
    assert "serve" in run([script, "--help"], env, target.parent).stdout
    assert "--redis-url" in run([script, "serve", "--help"], env, target.parent).stdout
    model = target.parent / "tiny"
    run([script, "init-model", str(model)], env, target.parent)
    assert {"config.json", "model.safetensors"} <= {p.name for p in model.iterdir()}
