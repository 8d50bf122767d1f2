#!/usr/bin/env bash
# One short device call that measures as much as fits: `bash deploy/gpu/visit.sh PART...`.
# The device machine lends 15 minutes in all (its start included), at most 10 a call, and
# returns at most 8 files: so every part runs under its own cap and a global deadline
# (VISIT_BUDGET_S, default 420 s), logs go to /tmp/visit, and after each part all of them are
# bundled into $OUT/visit.tgz (what is there comes back even when the call is killed), with a
# one-line verdict per part in $OUT/summary.txt, which first says the plan: setup's allowance
# plus every part's cap. No `make` needed. Parts, in the order given:
#   answer   THE next visit (issue 51, docs/gpu.md): answer-serve answer-ttft features step
#            engine under caps that fit 480 s in all (setup 20 + preflight 30 + 225 + 60 + 75
#            + 35 + 35; deadline 465 s, 15 s before, for the last kill); run alone
#   answer-serve  colocated vs disaggregated 1P+1D served on the one GPU (serve-bench.sh, the
#            ~0.9B shape): TTFT, TPOT and goodput at 2 and 8 req/s, one more rate searched per
#            mode, the largest rate meeting TTFT <= 2 s and TPOT <= 100 ms (90 % of requests)
#   answer-ttft   bench ttft, disaggregated, 8 prompts of 1024 tokens: served TTFT split into
#            queue, prefill worker compute, engine compute and hand-off
#   features the tests of what never ran on a GPU (FEATURE_TESTS below: structured outputs,
#            penalties and logit_bias, n > 1, preemption, migration, prefix load, HTTP, a
#            152k-row vocabulary's sampler memory, MoE models on the Triton fused-MoE kernel;
#            and the two-engines KV-sizing mend)
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
# VISIT_CPU=1 rehearses on CPU (tests/ops/test_gpu_visit.py): the tiny model, small loads and
# the CPU caps; the plan line still gives the GPU's. The longer plan, for a host lent longer,
# is `make gpu-session` (docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-visit}
logs=${VISIT_LOGS:-/tmp/visit}
mkdir -p "$out" "$logs"
export PYTHONUNBUFFERED=1 HALFMOON_CACHE=/tmp/halfmoon-cache RAY_AUTH_MODE=disabled

# Each part's cap on the GPU, seconds, by the name it is called; SETUP_S: the allowance for
# installing the wheelhouse and asking torch its version (about 10 s on the H200).
SETUP_S=20
declare -A cap=([preflight]=90 [tests]=270 [kernel-tests]=200 [failed]=200 [step]=110
  [eager]=80 [engine]=170 [kernels]=60 [ttft]=150 [ttft-both]=240 [transfer]=150 [serve]=470
  [answer-serve]=225 [answer-ttft]=60 [features]=180)
# What never ran on a GPU (issue 51), most important first. The engine's device is `auto`, and
# the cluster tests' workers ask Ray for no GPU, which then leaves it visible: all run on CUDA.
FEATURE_TESTS=(
  tests/engine/test_structured_output.py
  tests/engine/test_penalties.py
  tests/engine/test_parallel_sampling.py
  tests/engine/test_decode_graphs.py::test_decode_graphs_survive_preemption_and_new_arrivals
  tests/engine/test_warmup.py::test_no_kernel_compiles_after_a_cuda_engine_is_ready
  tests/engine/test_cuda_paths.py::test_two_engines_on_one_gpu_size_their_kv_within_their_share
  tests/engine/test_wide_vocab.py
  tests/engine/test_exactness.py::test_greedy_tokens_on_cuda_in_fp32_match_transformers_on_cuda
  tests/cluster/test_request_lifecycle.py
  tests/cluster/test_bench_prefix_load.py
  tests/cluster/test_openai_api.py
  tests/cluster/test_parallel_sampling_cluster.py
)
budget=${VISIT_BUDGET_S:-420}
answer=
if [ "${1:-}" = answer ]; then
  answer=1
  set -- answer-serve answer-ttft features step engine
  cap+=([preflight]=30 [features]=75 [step]=35 [engine]=35)
  budget=${VISIT_BUDGET_S:-465}  # of the 480 planned: a part past its cap has 15 s to stop
fi
planned=$SETUP_S
plan="setup $SETUP_S + preflight ${cap[preflight]}"
for what in preflight "$@"; do
  planned=$((planned + ${cap[$what]:-0}))
  [ "$what" = preflight ] || plan+=" + $what ${cap[$what]:-0}"
done
# The loads on the GPU; the CPU rehearsal's (VISIT_CPU=1): the same parts, the tiny model (or
# the ~50M one), small loads, caps of their own.
dev=cuda
serve_window=6  # s of arrivals a rate: 12 requests at 2 req/s, 48 at 8
ttft_load=(--prompt-tokens 1024 --requests 8)
test_workers=4
step_load=()
engine_load=(--requests 128)
if [ -n "${VISIT_CPU:-}" ]; then
  dev=cpu
  cap+=([preflight]=60 [answer-serve]=300 [answer-ttft]=120 [features]=90 [step]=60 [engine]=60)
  FEATURE_TESTS=(tests/engine/test_penalties.py::test_migrated_sequence_counts_its_earlier_output_as_generated)
  serve_window=  # serve-bench's own CPU load: 8 short requests a rate
  ttft_load=(--prompt-tokens 64 --requests 2)
  test_workers=0
  step_load=(--batch-sizes 1 --steps 3 --context 16)
  engine_load=(--requests 4 --scale 0.05)
  export SERVE_BENCH_CPU=1
  budget=${VISIT_BUDGET_S:-720}
fi
deadline=$(($(date +%s) + budget))

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

# quote FILE PREFIX [PATTERN]: FILE's lines (those matching PATTERN) into the summary.
quote() {
  grep -e "${3:-}" "$1" 2>/dev/null | sed "s/^/  $2| /" | tee -a "$logs/summary.txt"
}

# figures NAME: one line of figures from NAME.log (a benchmark's JSON) into the summary.
figures() {
  "$py" deploy/gpu/bench_figures.py "$logs/$1.log" | sed "s/^/  $1| /" | tee -a "$logs/summary.txt"
}

started=$(date +%s)
say "plan: $planned s on the GPU = $plan (deadline ${budget} s)"
nvidia-smi >"$logs/nvidia-smi.txt" 2>&1
source deploy/gpu/env.sh || {
  say "setup: installing the wheelhouse failed"
  bundle
  exit 1
}
py=$HALFMOON_PY
say "setup: ${HALFMOON_GPU:+GPU }in $(($(date +%s) - started))s; $("$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")' 2>&1 | tail -1)"
if [ -n "$answer" ] && [ -z "$HALFMOON_GPU" ] && [ "$dev" = cuda ]; then
  say "answer: no CUDA GPU here (and/or no .whl): every figure stays unmeasured (VISIT_CPU=1" \
    "rehearses it on CPU)"
  bundle
  exit 0
fi
part preflight "${cap[preflight]}" "$py" deploy/gpu/preflight.py
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
      part gpu-tests "${cap[tests]}" "${pytest[@]}" -n 4 --dist loadgroup --timeout 170 -m gpu \
        tests --junitxml="$logs/gpu-tests.xml"
      wait "$kernels"
      say "kernel-tests: rc=$? $(tail -n 1 "$logs/kernels.log")"
      bundle
      ;;
    kernel-tests)
      part kernel-tests "${cap[kernel-tests]}" "${pytest[@]}" -n 6 --timeout 150 -m "not slow" \
        tests/kernels --junitxml="$logs/kernel-tests.xml"
      ;;
    failed)
      # VISIT_RERUN (test ids), else the `gpu` tests an earlier `tests` part of this machine failed
      read -r -a ids <<<"${VISIT_RERUN:-}"
      ((${#ids[@]})) || mapfile -t ids < <(grep -o "^FAILED [^ ]*\|^ERROR [^ ]*" \
        "$logs/gpu-tests.log" "$logs/features.log" 2>/dev/null | cut -d' ' -f2 | sort -u)
      if ((${#ids[@]})); then
        part failed-again "${cap[failed]}" "${pytest[@]}" --timeout 170 "${ids[@]}"
      else
        say "failed: none to rerun"
      fi
      ;;
    answer-serve)
      say "answer: colocated (2 workers) vs disaggregated 1P+1D, served on the one $dev device;" \
        "in the disaggregated run its two processes time-slice it"
      part answer-serve "${cap[answer-serve]}" env OUT="$logs/serve" \
        SERVE_BENCH_MODEL="$HALFMOON_CACHE/bench-0.9b" SERVE_BENCH_BUDGET_S=$((cap[answer-serve] - 15)) \
        SERVE_BENCH_LIVE=0 SERVE_BENCH_RATES="2 8" SERVE_BENCH_SEARCH=1 \
        SERVE_BENCH_WINDOW_S="$serve_window" SERVE_BENCH_RUN_LIMIT_S=40 \
        bash deploy/gpu/serve-bench.sh
      quote "$logs/serve/summary.txt" answer-serve || say "  answer-serve| no summary: see serve.log"
      bundle
      ;;
    answer-ttft)
      # The served TTFT's split, one prompt at a time (text: the split is a line of its own).
      part answer-ttft "${cap[answer-ttft]}" "${bench[@]}" ttft --device "$dev" \
        --mode disaggregated "${ttft_load[@]}"
      quote "$logs/answer-ttft.log" answer-ttft "engine alone\|goal\|TTFT p50\|x the engine\|split p50"
      bundle
      ;;
    features)
      # -vv (past -q: one line a test): a call killed at its cap still shows each that ended;
      # by file: a module's cluster starts once
      part features "${cap[features]}" "${pytest[@]}" -vv -n "$test_workers" --dist loadfile \
        --timeout 60 "${FEATURE_TESTS[@]}" --junitxml="$logs/features.xml"
      tail -n 1 "$logs/features.log" | sed "s/^=* *//; s/ *=*$//; s/^/  features| /" |
        tee -a "$logs/summary.txt"
      bundle
      ;;
    step)
      part step "${cap[step]}" "${bench[@]}" step --json --device "$dev" "${step_load[@]}"
      figures step
      bundle
      ;;
    eager) part step-eager "${cap[eager]}" "${bench[@]}" step --json --device "$dev" --eager ;;
    engine)
      part engine "${cap[engine]}" "${bench[@]}" engine --json --device "$dev" --skip-hf-cb \
        "${engine_load[@]}"
      figures engine
      bundle
      ;;
    kernels) part kernels "${cap[kernels]}" "${bench[@]}" kernels --json ;;
    ttft) part ttft "${cap[ttft]}" "${bench[@]}" ttft --json --device cuda --mode disaggregated \
      --prompt-tokens 1024 --requests 16 ;;
    ttft-both) part ttft-both "${cap[ttft-both]}" "${bench[@]}" ttft --json --device cuda \
      --mode both --prompt-tokens 1024 --requests 16 ;;
    serve) part serve "${cap[serve]}" env OUT="$logs/serve" SERVE_BENCH_BUDGET_S=420 \
      bash deploy/gpu/serve-bench.sh ;;
    transfer) part transfer "${cap[transfer]}" "${bench[@]}" transfer --json --device cuda \
      --repeats 3 --chunks 1,4 ;;
    *) say "$what: no such part" ;;
  esac
done
say "visit: $(($(date +%s) - started))s (planned $planned s on the GPU)"
bundle
