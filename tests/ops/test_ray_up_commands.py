"""What the `ray up` YAMLs run exists: every repository path and console script their
commands name, the extras `ray up` needs, and the model where the GPU config expects it."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
YAMLS = ["aws.yaml", "onprem.yaml"]
COMMAND_LISTS = (
    "initialization_commands",
    "setup_commands",
    "head_setup_commands",
    "worker_setup_commands",
    "head_start_ray_commands",
    "worker_start_ray_commands",
)
# `~/halfmoon/...` or `/home/USER/halfmoon/...`: the checkout file_mounts copies to each node.
# Files the docs name that no checkout holds: the subject of an example error message, and the
# targets file the router writes at run time.
NOT_IN_REPO = {"deploy/configs/mine.yaml", "deploy/prometheus/targets/halfmoon.json"}
# What deploy/ray/make-secrets.sh writes before `ray up` (ignored by git).
SECRETS = "deploy/ray/secrets/"
REPO_PATH = re.compile(r"(?:~|/home/\w+)/halfmoon/([\w./-]+)")
VENV_SCRIPT = re.compile(r"~/venv/bin/([\w.-]+)")
DOWNLOAD = re.compile(r"hf download (\S+) --local-dir (\S+)")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "ray" / name).read_text())


def commands(config: dict) -> list[str]:
    return [command for key in COMMAND_LISTS for command in config.get(key) or []]


def console_scripts() -> set[str]:
    """The scripts pyproject declares, those of every installed distribution, and the venv's own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {ep.name for ep in entry_points(group="console_scripts")}
    return set(project["scripts"]) | installed | {"python", "python3", "pip", "activate"}


@pytest.mark.parametrize("name", YAMLS)
def test_the_checkout_is_mounted_on_every_node(name):
    mounts = load(name)["file_mounts"]
    assert [target for target, source in mounts.items() if source == "."] != []
    for target, source in mounts.items():
        assert (ROOT / source).exists(), f"{name}: file_mounts {target}: {source} is missing"


@pytest.mark.parametrize("name", YAMLS)
def test_every_repository_path_the_commands_name_exists(name):
    named = [path for command in commands(load(name)) for path in REPO_PATH.findall(command)]
    assert named, f"{name} names no repository path"
    made = {path for path in named if path.startswith(SECRETS)}
    assert [path for path in named if path not in made and not (ROOT / path).exists()] == []
    written = (ROOT / "deploy/ray/make-secrets.sh").read_text()
    assert all(path.removeprefix(SECRETS) in written for path in made)


@pytest.mark.parametrize("name", YAMLS)
def test_every_node_starts_ray_with_token_auth(name):
    config = load(name)
    keys = ("head_start_ray_commands", "worker_start_ray_commands")
    starts = [command for key in keys for command in config[key] if "ray start" in command]
    assert starts and all("RAY_AUTH_MODE=token" in c for c in starts)


@pytest.mark.parametrize("name", YAMLS)
def test_every_console_script_the_commands_run_exists(name):
    scripts = {s for command in commands(load(name)) for s in VENV_SCRIPT.findall(command)}
    assert {"pip", "ray", "hf"} <= scripts
    assert sorted(scripts - console_scripts()) == []


@pytest.mark.parametrize("name", YAMLS)
def test_nodes_install_ray_default_and_halfmoon(name):
    setup = " ".join(load(name)["setup_commands"])
    assert '"ray[default]==' in setup
    assert "pip install -q -e ~/halfmoon" in setup
    if name == "aws.yaml":
        assert "boto3" in setup


@pytest.mark.parametrize("name", YAMLS)
def test_redis_runs_on_the_head_beside_ray_not_on_its_gcs_port(name):
    config = load(name)
    head = " ".join(config["head_start_ray_commands"])
    assert "--port=6379" in head
    assert "deploy/ray/start-redis.sh 6380" in head
    assert "redis-server --port" not in " ".join(config["worker_start_ray_commands"])


@pytest.mark.parametrize("name", YAMLS)
def test_every_node_fetches_the_model_the_gpu_config_serves(name):
    setup = " ".join(load(name)["setup_commands"])
    downloads = DOWNLOAD.findall(setup)
    gpu = yaml.safe_load((ROOT / "deploy" / "configs" / "gpu-cluster.yaml").read_text())
    assert [local_dir for _, local_dir in downloads] == [gpu["model"]]


def test_gpu_config_sizes_the_host_tier_from_the_node_and_gives_workers_gpus():
    gpu = yaml.safe_load((ROOT / "deploy" / "configs" / "gpu-cluster.yaml").read_text())
    assert 0 < gpu["store"]["host_memory_fraction"] < 1
    assert "host_capacity_bytes" not in gpu["store"]
    for pool in ("prefill", "decode"):
        assert gpu[pool]["num_gpus"] == 1
        assert gpu[pool]["resources"] == {pool: 1}


def test_documented_commands_name_existing_paths():
    text = (ROOT / "docs" / "deploy.md").read_text()
    named = REPO_PATH.findall(text) + re.findall(r"\b(deploy/[\w./-]+\w)", text)
    assert named
    missing = {path for path in named if not (ROOT / path).exists()} - NOT_IN_REPO
    missing = {path for path in missing if not path.startswith(SECRETS.rstrip("/"))}
    assert sorted(missing) == []
