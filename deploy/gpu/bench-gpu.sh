#!/usr/bin/env bash
# The GPU benchmarks of issues 12, 13 and 17, each ours against its baseline in one run; JSON
# results and logs go to $OUT (default bench-gpu/). Needs a CUDA host.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
if [ -z "$HALFMOON_GPU" ]; then
  echo "bench-gpu: no CUDA GPU here (and/or no .whl wheelhouse); nothing to measure" >&2
  exit 0
fi
out=${OUT:-bench-gpu}
mkdir -p "$out"
# `bench-gpu.sh NAME...` runs only the named benchmarks (the device allows 10 minutes a call).
only=" $* "
run() {  # NAME ARGS...: `halfmoon bench ARGS`, JSON to $out/NAME.json, log to $out/NAME.log
  local name=$1
  shift
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then
    return 0
  fi
  echo "== bench $*" >&2
  "$HALFMOON_PY" -m halfmoon.cluster.cli bench "$@" >"$out/$name.json" 2>"$out/$name.log" ||
    echo "bench $name failed (see $out/$name.log)" >&2
  cat "$out/$name.json"
}
run step step --device cuda --json
run step-eager step --device cuda --eager --json
run kernels kernels --json
run engine engine --device cuda --eager --json
run rdt rdt --device cuda --json
run rdt-gpu-shape rdt --device cuda --shape gpu --tokens 1024,4096,8192 --requests 10 --json
# Issue 12: the stall after the last layer (lent pages vs the arena vs through the store vs no
# streaming), 0.9B shape, prompts of 256-2048 tokens; p50 and p99 over 40 requests a path.
run transfer transfer --device cuda --repeats 10 --json
# Issue 12: a stored prefix loaded by another prefill worker, out of the arena vs as Ray objects.
run prefix-load prefix-load --device cuda --tokens 512,2048,4064 --json
# Issue 13: served TTFT against the engine's own prefill, one at a time and at 2 req/s.
run ttft ttft --device cuda --prompt-tokens 1024 --requests 24 --json
run ttft-2rps ttft --device cuda --prompt-tokens 1024 --requests 48 --max-tokens 128 --request-rate 2 --json
# The serving benchmarks (issues 12 and 17) with what is left of the device's 10 minutes; a
# step that no longer fits is skipped (then run `make bench-gpu BENCH=serve` alone).
if [ "$only" = "  " ] || [[ "$only" == *" serve "* ]]; then
  OUT="$out" SERVE_BENCH_BUDGET_S=$((570 - SECONDS)) bash deploy/gpu/serve-bench.sh ||
    echo "serve-bench failed (see $out/)" >&2
fi
