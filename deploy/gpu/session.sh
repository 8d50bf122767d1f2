#!/usr/bin/env bash
# One step of the GPU session (`make gpu-session STEP=N`; deploy/gpu/session_plan.py lists the
# four, docs/gpu.md says what each measures): installs the wheelhouse once (env.sh's stamp),
# then deploy/gpu/session.py runs the step into $OUT/step-N (default gpu-session/step-N).
# GPU_SESSION_CPU=1 rehearses it on CPU with the tiny model (tests/ops/test_gpu_session.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
export HALFMOON_GPU
exec "$HALFMOON_PY" deploy/gpu/session.py "$@"
