#!/usr/bin/env bash
# The GPU suite: on a CUDA host the kernel tests compiled by Triton (not interpreted, as on
# CPU), then every `gpu` test; anywhere else, in .venv, every `gpu` test is skipped. Both parts
# run even when the first fails (a device run is short); the exit status is the first failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
status=0
if [ -n "$HALFMOON_GPU" ]; then
  "$HALFMOON_PY" -m pytest -p no:cacheprovider -m "not slow" tests/kernels "$@" || status=$?
fi
gpu_status=0
"$HALFMOON_PY" -m pytest -p no:cacheprovider -m gpu tests "$@" || gpu_status=$?
[ "$status" -ne 0 ] || status=$gpu_status
exit "$status"
