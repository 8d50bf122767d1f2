#!/usr/bin/env bash
# The GPU suite: on a CUDA host the kernel tests compiled by Triton (not interpreted, as on
# CPU), then every `gpu` test; anywhere else, in .venv, every `gpu` test is skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
if [ -n "$HALFMOON_GPU" ]; then
  "$HALFMOON_PY" -m pytest -p no:cacheprovider -m "not slow" tests/kernels "$@"
fi
exec "$HALFMOON_PY" -m pytest -p no:cacheprovider -m gpu tests "$@"
