#!/usr/bin/env bash
# Builds .whl/: what a GPU host without internet lacks to run halfmoon and its GPU suite
# (Python 3.12 x86_64 wheels, Ray's repacked to fit the device tool's 64 MiB carry, and the
# redis-server .debs). Versions follow this checkout's .venv, so both machines run the same code.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.whl}
PY=${PY:-.venv/bin/python}
# Not in the GPU image (its package list is in the device tool's KINDS.md); dependencies too.
# grpcio and protobuf are there, at versions unknown: the generated stubs (cluster/api) refuse
# a runtime older than the grpcio-tools that made them, so this checkout's versions travel.
# httpx2 (bench serve, bench live-capacity, openai) is not there; the image has httpx only.
PACKAGES=(
  ray redis pydantic pydantic-core annotated-types typing-inspection
  grpcio grpcio-health-checking grpcio-reflection protobuf fastapi starlette uvicorn
  openai distro jiter sniffio jsonschema jsonschema-specifications referencing rpds-py
  httpx2 httpcore2 truststore
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 any)

pinned() {  # NAME==VERSION as installed in .venv, or NAME when it is not installed there
  local version
  version=$("$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p')
  if [ -n "$version" ]; then echo "$1==$version"; else echo "$1"; fi
}

rm -rf "$OUT" && mkdir -p "$OUT/deb"
specs=()
for name in "${PACKAGES[@]}"; do specs+=("$(pinned "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp ${PLATFORMS[@]/#/--platform } -d "$OUT" "${specs[@]}"

# Ray's wheel is ~79 MB; without its Java jars, RLlib and the dashboard's web client it is ~52 MB.
ray_wheel=$(ls "$OUT"/ray-*.whl)
"$PY" - "$ray_wheel" <<'PYTHON'
import sys, zipfile, pathlib, base64, hashlib
path = pathlib.Path(sys.argv[1])
drop = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/")
tmp = path.with_suffix(".tmp")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    kept = [i for i in src.infolist() if not i.filename.startswith(drop)]
    rows = []
    for info in kept:
        if info.filename == record_name:
            continue
        data = src.read(info)
        dst.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{info.filename},sha256={digest},{len(data)}")
    dst.writestr(record_name, "\n".join(rows + [f"{record_name},,"]) + "\n")
tmp.replace(path)
PYTHON

# redis-server for the Redis tier's tests there; unpacked under /tmp, never over /.
if command -v apt-get >/dev/null; then
  (cd "$OUT/deb" && apt-get download redis-server redis-tools liblzf1 libjemalloc2 2>/dev/null) ||
    echo "wheelhouse: apt-get download failed; the GPU suite will skip its Redis tests" >&2
fi
du -sh "$OUT"
