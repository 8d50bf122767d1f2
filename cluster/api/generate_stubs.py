"""Regenerate the checked-in gRPC stubs from `halfmoon.proto`; `--check` only compares."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

API_DIR = Path(__file__).resolve().parent
REPO_ROOT = API_DIR.parents[1]
PROTO = "halfmoon/cluster/api/halfmoon.proto"
STUBS = ("halfmoon_pb2.py", "halfmoon_pb2.pyi", "halfmoon_pb2_grpc.py")


def generate() -> dict[str, str]:
    """The stubs protoc writes today, by file name."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as include, tempfile.TemporaryDirectory() as out:
        # Importing through a `halfmoon` link makes the stubs import `halfmoon.cluster.api...`.
        os.symlink(REPO_ROOT, Path(include) / "halfmoon")
        args = [
            "grpc_tools.protoc",
            f"-I{include}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(Path(include) / PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {API_DIR / 'halfmoon.proto'}")
        generated = Path(out) / Path(PROTO).parent
        return {name: (generated / name).read_text() for name in STUBS}


def stale_stubs() -> list[str]:
    """Names of checked-in stubs that differ from what protoc generates now."""
    fresh = generate()
    return [n for n in STUBS if _read(API_DIR / n) != fresh[n]]


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        if stale:
            print(f"stale gRPC stubs: {', '.join(stale)}; run `make proto`", file=sys.stderr)
            return 1
        print("gRPC stubs are current")
        return 0
    for name, text in generate().items():
        (API_DIR / name).write_text(text)
    print(f"wrote {', '.join(STUBS)} to {API_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
