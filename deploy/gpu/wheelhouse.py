"""The offline wheelhouse: what a host without internet lacks to run halfmoon, as wheels.

A GPU host often has CUDA torch, Triton and transformers installed and no internet (the device
machine this project measures on is one). `make wheelhouse` runs `build` here, where the
internet is; `make install-wheelhouse` runs `install` there, from the copied folder.

    build    downloads, for one Python version and platform, a wheel of every distribution
             halfmoon needs (with its `dev` extra, for the test suite) that the host's image
             does not hold, each at the version this checkout's environment runs; slims Ray's
             wheel to fit a 64 MiB carry; adds redis-server's .debs; writes wheelhouse.json.
             Not the `transfer-*` extras: Mooncake's Transfer Engine wheel (93 MiB for CUDA,
             44 MiB without) does not fit the carry, and one node sends no KV across machines
    install  checks wheelhouse.json against the Python running it, installs the wheels into
             PREFIX/site with `pip --no-index --no-deps` (once: a stamp in PREFIX holds the
             installed wheelhouse.json's digest), unpacks redis-server into
             PREFIX/redis, links the checkout as PREFIX/src/halfmoon, and prints the
             environment that runs halfmoon from there (`--print-env`: shell lines to eval)
    plan     prints what `build` would download, one NAME==VERSION a line, and why

Which distributions the host holds is a list of names (deploy/gpu/image-packages.txt for the
device machine); `build` does not look inside them for their own dependencies.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_IMAGE = ROOT / "deploy" / "gpu" / "image-packages.txt"
MANIFEST = "wheelhouse.json"
# Tools of the `dev` extra that running halfmoon and its tests does not need.
SKIP = {"ruff": "a linter", "grpcio-tools": "regenerates the checked-in stubs (`make proto`)"}
# Carried even when the host has them, at this checkout's version: the generated stubs in
# cluster/api refuse a grpcio or protobuf runtime older than the grpcio-tools that made them;
# pydantic needs typing-extensions >= 4.16 and Ray packaging >= 24.2, and the image's list
# (names only) cannot say which it holds (both wheels are under 100 KB).
ALWAYS_CARRY = {"grpcio", "protobuf", "typing-extensions", "packaging"}
# What one device call may carry in all (the wheelhouse and the checkout's tracked files), less
# a margin for untracked files that travel too: `build` fails past it, not a GPU session.
CARRY_LIMIT_BYTES = 62 << 20
# Ray's wheel is ~79 MB; without its Java jars, RLlib and the dashboard's web client it is
# ~52 MB (43 MB for 2.60), and without its libraries (Data, Serve, Train, Tune, LLM) 3-4 MB less
# again; halfmoon uses none of them (the wheelhouse rehearsal in tests/ops serves from it).
RAY_DROP = (
    "ray/jars/",
    "ray/rllib/",
    "ray/dashboard/client/",
    "ray/data/",
    "ray/serve/",
    "ray/train/",
    "ray/tune/",
    "ray/llm/",
)
DEBS = ["redis-server", "redis-tools", "liblzf1", "libjemalloc2"]
DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
# In PREFIX: the digest of the wheelhouse.json installed there, so a second `install` of the
# same wheelhouse (every GPU script sources env.sh) takes a second, not a minute.
STAMP = "installed.sha256"


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path) -> set[str]:
    """The distribution names in an image list: one a line, `#` comments, `==VERSION` ignored."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0]))
    return names


def target_environment(python_version: str, arch: str) -> dict[str, str]:
    """The marker environment of a Linux CPython `python_version` host on `arch`."""
    from packaging.markers import default_environment  # build's; install runs without it

    return {
        **default_environment(),
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "platform_machine": arch,
        "platform_system": "Linux",
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }


@dataclass(frozen=True, slots=True)
class Carried:
    """One distribution to carry: its version here (None: not installed here) and who needs it."""

    name: str
    version: str | None
    needed_by: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name


def plan(
    python_version: str, arch: str, image: set[str], root: str = "halfmoon", extras=("dev",)
) -> list[Carried]:
    """Every distribution `root[extras]` needs on the target that `image` lacks, walked through
    this environment's installed metadata, sorted by name."""
    from packaging.requirements import Requirement

    environment = target_environment(python_version, arch)
    carried: dict[str, Carried] = {}
    walked: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonical(root), frozenset(extras), "")]
    while todo:
        name, wanted, parent = todo.pop()
        if (name, wanted) in walked:
            continue
        walked.add((name, wanted))
        if parent:
            if name in SKIP or (name in image and name not in ALWAYS_CARRY):
                continue
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                version = None
            carried.setdefault(name, Carried(name, version, parent))
            if version is None:
                continue  # not installed here: pip resolves it, its dependencies unknown
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(
                marker.evaluate({**environment, "extra": extra}) for extra in ("", *wanted)
            ):
                needed = canonical(requirement.name)
                todo.append((needed, frozenset(requirement.extras), name))
    return sorted(carried.values(), key=lambda c: c.name)


def platforms(arch: str) -> list[str]:
    """pip's --platform tags a manylinux host on `arch` accepts, newest first."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in (28, 27, 24, 17)]
    tags.append(f"manylinux2014_{arch}")
    if arch == "x86_64":
        tags.append("manylinux1_x86_64")
    return [*tags, "any"]


def slim_ray(wheel: Path) -> None:
    """Rewrites Ray's wheel without RAY_DROP, with a RECORD that matches what is left."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in src.infolist():
            if info.filename.startswith(RAY_DROP) or info.filename == record:
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{info.filename},sha256={digest.decode()},{len(data)}")
        dst.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    tmp.replace(wheel)


def download_debs(out: Path, arch: str) -> list[str]:
    """redis-server's .debs for `arch` into out/deb, when this machine's apt can fetch them."""
    here = platform.machine()
    if arch != here or shutil.which("apt-get") is None:
        why = "no apt-get here" if arch == here else f"this machine is {here}, not {arch}"
        print(f"wheelhouse: no redis-server .debs ({why}); the host needs its own", file=sys.stderr)
        return []
    deb_dir = out / "deb"
    deb_dir.mkdir()
    result = subprocess.run(["apt-get", "download", *DEBS], cwd=deb_dir, capture_output=True)
    if result.returncode != 0:
        print(
            "wheelhouse: apt-get download failed; the host's Redis tests will be skipped:\n"
            + result.stderr.decode(errors="replace"),
            file=sys.stderr,
        )
    return sorted(p.name for p in deb_dir.glob("*.deb"))


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    carried = plan(args.python_version, args.arch, read_image(Path(args.image)))
    unpinned = [c.name for c in carried if c.version is None]
    if unpinned:
        names = ", ".join(unpinned)
        print(f"wheelhouse: not installed here, latest taken: {names}", file=sys.stderr)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print(f"wheelhouse: {len(carried)} wheels for Python {args.python_version} on {args.arch}")
    tags = [arg for tag in platforms(args.arch) for arg in ("--platform", tag)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            args.python_version,
            "--implementation",
            "cp",
            *tags,
            "-d",
            str(out),
            *(c.spec for c in carried),
        ],
        check=True,
    )
    for wheel in out.glob("ray-*.whl"):
        before = wheel.stat().st_size >> 20
        slim_ray(wheel)
        after = wheel.stat().st_size >> 20
        print(f"wheelhouse: {wheel.name} slimmed {before} -> {after} MiB")
    debs = download_debs(out, args.arch) if args.debs else []
    manifest = {
        "python_version": args.python_version,
        "arch": args.arch,
        "built": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wheels": sorted(p.name for p in out.glob("*.whl")),
        "debs": debs,
        "carried": {c.name: {"version": c.version, "needed_by": c.needed_by} for c in carried},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"wheelhouse: {out}/ holds {len(manifest['wheels'])} wheels, {len(debs)} .debs, "
        f"{size / 2**20:.0f} MiB"
    )
    problem = carry_problem(size, tracked_bytes())
    if problem:
        print(f"wheelhouse: {problem}", file=sys.stderr)
        return 1
    return 0


def tracked_bytes(root: Path = ROOT) -> int:
    """Bytes of the checkout's tracked files: the working tree a device call copies."""
    names = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True
    ).stdout.split(b"\0")
    paths = (root / name.decode() for name in names if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def carry_problem(wheelhouse_bytes: int, tree_bytes: int) -> str | None:
    """Why a wheelhouse and the tree would not fit one device call's carry (None: they do)."""
    total = wheelhouse_bytes + tree_bytes
    if total <= CARRY_LIMIT_BYTES:
        return None
    return (
        f"the wheelhouse ({wheelhouse_bytes / 2**20:.1f} MiB) and the tracked tree "
        f"({tree_bytes / 2**20:.1f} MiB) come to {total / 2**20:.1f} MiB, past the "
        f"{CARRY_LIMIT_BYTES >> 20} MiB a device call may carry with room to spare: slim a "
        "wheel (RAY_DROP) or carry less"
    )


def install(args: argparse.Namespace) -> int:
    wheelhouse, prefix = Path(args.wheelhouse).resolve(), Path(args.prefix).resolve()
    manifest_path = wheelhouse / MANIFEST
    if not manifest_path.is_file():
        sys.exit(
            f"install: {manifest_path} not found; run `make wheelhouse` where pip can "
            "reach PyPI and copy the folder here"
        )
    manifest = json.loads(manifest_path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if (manifest["python_version"], manifest["arch"]) != (here, platform.machine()):
        sys.exit(
            f"install: {wheelhouse} is for Python {manifest['python_version']} on "
            f"{manifest['arch']}, this is Python {here} on {platform.machine()} "
            f"({sys.executable}); rebuild it with `make wheelhouse WHEEL_PYTHON={here} "
            f"WHEEL_ARCH={platform.machine()}`"
        )
    missing = [name for name in manifest["wheels"] if not (wheelhouse / name).is_file()]
    if missing:
        sys.exit(f"install: {wheelhouse} lacks {', '.join(missing)} (a partial copy?)")
    src, log = prefix / "src", sys.stderr
    stamp, wanted = prefix / STAMP, stamp_of(manifest_path)
    if stamp.is_file() and stamp.read_text() == wanted:
        print(f"install: {wheelhouse} is installed in {prefix} already ({STAMP})", file=log)
    else:
        install_files(wheelhouse, manifest, prefix)
        prefix.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)
    src.mkdir(parents=True, exist_ok=True)
    link = src / "halfmoon"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(ROOT)
    environment = offline_environment(prefix, bool(manifest["debs"]))
    if args.print_env:
        for key, value in environment.items():
            print(f'export {key}="{value}"')
    else:
        print("install: done; to run halfmoon from it:", file=log)
        for key, value in environment.items():
            print(f'  export {key}="{value}"', file=log)
        print(f"  {Path(sys.executable).name} -m halfmoon.cluster.cli --help", file=log)
    return 0


def stamp_of(manifest_path: Path) -> str:
    """What the install stamp holds: the manifest's digest (another wheelhouse reinstalls)."""
    return hashlib.sha256(manifest_path.read_bytes()).hexdigest() + "\n"


def install_files(wheelhouse: Path, manifest: dict, prefix: Path) -> None:
    """The wheels into PREFIX/site (pip, no index) and redis-server's .debs into PREFIX/redis."""
    site = prefix / "site"
    print(f"install: {len(manifest['wheels'])} wheels into {site}", file=sys.stderr)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *(str(wheelhouse / name) for name in manifest["wheels"]),
        ],
        check=True,
        stdout=sys.stderr,
    )
    for deb in manifest["debs"]:
        deb_path = str(wheelhouse / "deb" / deb)
        subprocess.run(["dpkg", "-x", deb_path, str(prefix / "redis")], check=True)


def offline_environment(prefix: Path, with_redis: bool) -> dict[str, str]:
    """The variables that run halfmoon from an installed prefix: the checkout's link and the
    wheels on PYTHONPATH; redis-server and the libraries it links (which a slim image may
    lack) on PATH and LD_LIBRARY_PATH."""

    def joined(first: list[str], variable: str) -> str:
        rest = os.environ.get(variable, "").split(os.pathsep)
        return os.pathsep.join([*first, *filter(None, rest)])

    environment = {"PYTHONPATH": joined([str(prefix / "src"), str(prefix / "site")], "PYTHONPATH")}
    if with_redis:
        libs = [str(p) for p in sorted((prefix / "redis" / "usr" / "lib").glob("*-linux-gnu"))]
        environment["PATH"] = joined([str(prefix / "redis" / "usr" / "bin")], "PATH")
        environment["LD_LIBRARY_PATH"] = joined(libs, "LD_LIBRARY_PATH")
    return environment


def show_plan(args: argparse.Namespace) -> int:
    for carried in plan(args.python_version, args.arch, read_image(Path(args.image))):
        print(f"{carried.spec:40} needed by {carried.needed_by}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="wheelhouse.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, doc in (("build", "download the wheelhouse"), ("plan", "print what build takes")):
        command = commands.add_parser(name, help=doc)
        command.add_argument(
            "--python-version", default="3.12", help="the host's Python, MAJOR.MINOR (3.12)"
        )
        command.add_argument(
            "--arch", default="x86_64", choices=sorted(DEB_ARCH), help="the host's CPU (x86_64)"
        )
        command.add_argument(
            "--image",
            default=str(DEFAULT_IMAGE),
            help="distributions the host already has, a name a line (the device machine's)",
        )
        if name == "build":
            command.add_argument("--out", default=".whl", help="the folder to write (.whl)")
            command.add_argument(
                "--no-debs", dest="debs", action="store_false", help="leave out redis-server"
            )
    command = commands.add_parser("install", help="install a wheelhouse on this host")
    command.add_argument("--wheelhouse", default=".whl", help="the folder build wrote (.whl)")
    command.add_argument(
        "--prefix",
        default="/tmp/halfmoon-offline",
        help="where to install: PREFIX/site, PREFIX/redis, PREFIX/src (/tmp/halfmoon-offline)",
    )
    command.add_argument(
        "--print-env", action="store_true", help="print `export` lines for the shell to eval"
    )
    args = parser.parse_args(argv)
    return {"build": build, "install": install, "plan": show_plan}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
