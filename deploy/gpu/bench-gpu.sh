#!/usr/bin/env bash
# The GPU benchmarks of issues 12, 13 and 17, each ours against its baseline: the commands of
# deploy/gpu/session_plan.py, each under its time limit, within one device call's budget.
# `bench-gpu.sh NAME...` runs only those (names: `python deploy/gpu/session.py --plan`); JSON
# results, logs and summary.json go to $OUT (default bench-gpu/). Needs a CUDA host; a whole
# GPU visit is `make gpu-session STEP=1..4` instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
export HALFMOON_GPU
export OUT=${OUT:-bench-gpu}
exec "$HALFMOON_PY" deploy/gpu/session.py --only "$@"
