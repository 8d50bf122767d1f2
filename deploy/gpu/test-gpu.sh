#!/usr/bin/env bash
# The GPU suite: on a CUDA host the kernel tests compiled by Triton (not interpreted, as on
# CPU), then every `gpu` test; anywhere else, in .venv, every `gpu` test is skipped. Both parts
# run even when the first fails (a device run is short); the exit status is the first failure.
# Every test is stopped after GPU_TEST_TIMEOUT_S (default 240 s; a test's own timeout marker
# overrides it), so one hung test costs minutes, not the run. GPU_TEST_PATHS (default: tests)
# narrows the `gpu` part. The preflight (deploy/gpu/preflight.py: a C compiler, Python.h, one
# Triton kernel) runs first, unless GPU_PREFLIGHT_DONE is set (a session step ran it): without
# a compiler or Python.h every kernel would fail at its first launch.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
timeout_s=${GPU_TEST_TIMEOUT_S:-240}
read -r -a paths <<<"${GPU_TEST_PATHS:-tests}"
pytest=("$HALFMOON_PY" -m pytest -p no:cacheprovider --timeout="$timeout_s")
[ -n "${GPU_PREFLIGHT_DONE:-}" ] || "$HALFMOON_PY" deploy/gpu/preflight.py || exit 1
status=0
if [ -n "$HALFMOON_GPU" ]; then
  "${pytest[@]}" -m "not slow" tests/kernels "$@" || status=$?
fi
gpu_status=0
"${pytest[@]}" -m gpu "${paths[@]}" "$@" || gpu_status=$?
[ "$status" -ne 0 ] || status=$gpu_status
exit "$status"
