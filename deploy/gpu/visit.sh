#!/usr/bin/env bash
# One short device call that measures as much as fits: `bash deploy/gpu/visit.sh PART...`.
# The device machine lends 15 minutes in all (its start included), at most 10 a call, and
# returns at most 8 files: so every part runs under its own cap and a global deadline
# (VISIT_BUDGET_S, default 420 s), logs go to /tmp/visit, and after each part all of them are
# bundled into $OUT/visit.tgz (what is there comes back even when the call is killed), with a
# one-line verdict per part in $OUT/summary.txt. Parts, in the order given:
#   tests    the Triton kernel tests compiled (background, xdist) beside every `gpu` test
#            (xdist by file): correctness first; timings of these are not figures
#   kernel-tests  only the Triton kernel tests, compiled (xdist)
#   failed   the tests named in VISIT_RERUN, else the `gpu` tests that failed in an earlier
#            `tests` part of this machine, one at a time
#   step     bench step with CUDA graphs (issue 13: wall <= 1.3x kernel time at batch 1, 64)
#   eager    bench step --eager
#   engine   bench engine --device cuda --skip-hf-cb (>= 6x transformers static)
#   kernels  bench kernels
#   ttft     bench ttft (alone, 1024-token prompts; served TTFT p50 <= 2x engine + 5 ms)
#   ttft-both  the same, colocated too: one process, so no time-slicing of the GPU (splits the
#            disaggregated gap into the worker's own cost and the sharing of the GPU)
#   transfer bench transfer (KV stall p50 <= 1.2x one layer's move)
#   serve    deploy/gpu/serve-bench.sh (issues 12 and 17), its files bundled too
# The longer plan, for a host lent longer, is `make gpu-session` (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-visit}
logs=${VISIT_LOGS:-/tmp/visit}
mkdir -p "$out" "$logs"
deadline=$(($(date +%s) + ${VISIT_BUDGET_S:-420}))
export PYTHONUNBUFFERED=1 HALFMOON_CACHE=/tmp/halfmoon-cache RAY_AUTH_MODE=disabled

bundle() {
  cp "$logs/summary.txt" "$out/summary.txt" 2>/dev/null
  tar czf "$out/visit.tgz.part" -C "$logs" . && mv "$out/visit.tgz.part" "$out/visit.tgz"
}

say() { echo "$*" | tee -a "$logs/summary.txt"; }

# part NAME CAP_S COMMAND...: COMMAND under min(CAP_S, time left), its output in NAME.log.
part() {
  local name=$1 cap=$2 left started rc
  shift 2
  left=$((deadline - $(date +%s)))
  if ((left < 30)); then
    say "$name: skipped, ${left}s left"
    return
  fi
  ((cap > left)) && cap=$left
  started=$(date +%s)
  timeout -k 15 "$cap" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  say "$name: rc=$rc in $(($(date +%s) - started))s (cap ${cap}s)$([ $rc -eq 124 ] && echo ' TIMED OUT')"
  tail -n 4 "$logs/$name.log" | sed "s/^/  $name| /"
  bundle
}

started=$(date +%s)
nvidia-smi >"$logs/nvidia-smi.txt" 2>&1
source deploy/gpu/env.sh || {
  say "setup: installing the wheelhouse failed"
  bundle
  exit 1
}
py=$HALFMOON_PY
say "setup: ${HALFMOON_GPU:+GPU }in $(($(date +%s) - started))s; $("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")' 2>&1 | tail -1)"
part preflight 90 "$py" deploy/gpu/preflight.py
bench=("$py" -m halfmoon.cluster.cli bench)
pytest=("$py" -m pytest -p no:cacheprovider -q -rfE --durations=40)

for what in "$@"; do
  case $what in
    tests)
      timeout -k 15 240 "${pytest[@]}" -n 6 --timeout 150 -m "not slow" tests/kernels \
        --junitxml="$logs/kernels.xml" >"$logs/kernels.log" 2>&1 &
      kernels=$!
      # loadgroup: the tests that take GPU memory (an engine or a cluster each) share one
      # worker, one at a time (tests/conftest.py); several at once asked for more than the GPU has
      part gpu-tests 270 "${pytest[@]}" -n 4 --dist loadgroup --timeout 170 -m gpu tests \
        --junitxml="$logs/gpu-tests.xml"
      wait "$kernels"
      say "kernel-tests: rc=$? $(tail -n 1 "$logs/kernels.log")"
      bundle
      ;;
    kernel-tests)
      part kernel-tests 200 "${pytest[@]}" -n 6 --timeout 150 -m "not slow" tests/kernels \
        --junitxml="$logs/kernel-tests.xml"
      ;;
    failed)
      # VISIT_RERUN (test ids), else the `gpu` tests an earlier `tests` part of this machine failed
      read -r -a ids <<<"${VISIT_RERUN:-}"
      ((${#ids[@]})) || mapfile -t ids < <(grep -o "^FAILED [^ ]*\|^ERROR [^ ]*" \
        "$logs/gpu-tests.log" 2>/dev/null | cut -d' ' -f2 | sort -u)
      if ((${#ids[@]})); then
        part failed-again 200 "${pytest[@]}" --timeout 170 "${ids[@]}"
      else
        say "failed: none to rerun"
      fi
      ;;
    step) part step 110 "${bench[@]}" step --json --device cuda ;;
    eager) part step-eager 80 "${bench[@]}" step --json --device cuda --eager ;;
    engine) part engine 170 "${bench[@]}" engine --json --device cuda --skip-hf-cb --requests 128 ;;
    kernels) part kernels 60 "${bench[@]}" kernels --json ;;
    ttft) part ttft 150 "${bench[@]}" ttft --json --device cuda --mode disaggregated --prompt-tokens 1024 \
      --requests 16 ;;
    ttft-both) part ttft-both 240 "${bench[@]}" ttft --json --device cuda --mode both \
      --prompt-tokens 1024 --requests 16 ;;
    serve) part serve 470 env OUT="$logs/serve" SERVE_BENCH_BUDGET_S=420 \
      bash deploy/gpu/serve-bench.sh ;;
    transfer) part transfer 150 "${bench[@]}" transfer --json --device cuda --repeats 3 --chunks 1,4 ;;
    *) say "$what: no such part" ;;
  esac
done
say "visit: $(($(date +%s) - started))s"
bundle
