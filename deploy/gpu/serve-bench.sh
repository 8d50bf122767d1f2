#!/usr/bin/env bash
# Issue 12's serving benchmark and issue 17's live capacity check, on one GPU, in one run:
# `halfmoon serve` with the ~0.9B bf16 bench model (SHAPES['gpu']), disaggregated 1P+1D and
# then colocated with 2 workers (num_gpus 0.3 each); in each mode `bench live-capacity` at three
# rates (fractions of the simulated capacity; SERVE_BENCH_LIVE=0 skips it) and `bench serve` at
# each of SERVE_BENCH_RATES (default 2 and 8 req/s; prompts 512-2048 tokens, 128 output tokens,
# Poisson; 48 requests, or rate x SERVE_BENCH_WINDOW_S and at least 12 when that is set), each
# judged against SERVE_BENCH_SLO (default TTFT <= 2 s and TPOT <= 100 ms for 90 % of requests).
# SERVE_BENCH_SEARCH=N then runs up to N more rates, each halfway (geometric) between the
# largest rate that met the SLOs and the smallest that missed (double or half past either end),
# and the summary names the largest rate met. JSON and logs go to $OUT (default bench-gpu/), the
# summary to $OUT/summary.txt too. Every run is bounded by `timeout` (SERVE_BENCH_RUN_LIMIT_S,
# default 150) and by a budget of $SERVE_BENCH_BUDGET_S (default 540 s) so the whole run stays
# inside the device's 10 minutes; about 6-7 minutes with the defaults.
# Without a CUDA GPU it exits 0 and measures nothing, unless SERVE_BENCH_CPU=1: a rehearsal of
# the same steps on CPU with the tiny default model and a small load (8 short requests).
# Both workers of the disaggregated run share the one GPU: it measures the KV transfer path and
# the engine, not the isolation of separate prefill and decode pools (the summary says so).
set -uo pipefail
cd "$(dirname "$0")/../.."
source deploy/gpu/env.sh
out=${OUT:-bench-gpu}
port=50071
metrics_port=9471
server=127.0.0.1:$port
if [ -n "$HALFMOON_GPU" ]; then
  model=${SERVE_BENCH_MODEL:-/tmp/halfmoon-bench-0.9b}
  engine=$(grep -v '^#' deploy/gpu/serve-engine.yaml | sed 's/^/  /')  # bf16, 1024-token chunks
  num_gpus=0.3
  num_prompts=48
  workload=(--random-input-len 1280 --random-range-ratio 0.6 --random-output-len 128
            --random-output-range-ratio 0)
elif [ -n "${SERVE_BENCH_CPU:-}" ]; then
  model=null  # the tiny default model
  engine="  num_pages: 1024"
  num_gpus=0
  num_prompts=8
  workload=(--random-input-len 256 --random-range-ratio 0.5 --random-output-len 16
            --random-output-range-ratio 0)
  echo "serve-bench: no GPU; SERVE_BENCH_CPU=1: a CPU rehearsal with the tiny model" >&2
else
  echo "serve-bench: no CUDA GPU here (and/or no .whl wheelhouse); nothing to measure" >&2
  exit 0
fi
mkdir -p "$out"
hm=("$HALFMOON_PY" -m halfmoon.cluster.cli)  # an array, not a function: `timeout` runs it
started=$SECONDS
budget=${SERVE_BENCH_BUDGET_S:-540}
read -r -a rates <<<"${SERVE_BENCH_RATES:-2 8}"
read -r -a slo <<<"${SERVE_BENCH_SLO:-ttft:2000 tpot:100}"
target=${SERVE_BENCH_TARGET:-0.9}  # share of requests within the SLOs that counts as met
run_limit=${SERVE_BENCH_RUN_LIMIT_S:-150}
report=("$HALFMOON_PY" deploy/gpu/serve_report.py)

# step ESTIMATE_S LIMIT_S NAME CMD...: run CMD under `timeout`, stdout to $out/NAME.json (or
# .out), stderr to $out/NAME.log; skipped when the budget has no LIMIT_S left.
step() {
  local estimate=$1 limit=$2 name=$3
  shift 3
  local left=$((budget - (SECONDS - started)))
  if [ "$left" -lt "$limit" ]; then
    echo "== $name: skipped, ${left} s of the ${budget} s budget left (needs up to ${limit} s)" >&2
    return 1
  fi
  echo "== $name (about ${estimate} s, at most ${limit} s; ${left} s of budget left)" >&2
  local t0=$SECONDS rc=0
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$out/$name.json" 2>"$out/$name.log" || rc=$?
  echo "   $name: exit $rc after $((SECONDS - t0)) s" >&2
  return $rc
}

serve_pid=
stop_server() {
  [ -n "$serve_pid" ] || return 0
  echo "== stop the server (about 10 s, at most 60 s)" >&2
  kill -TERM "$serve_pid" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$serve_pid" 2>/dev/null
  wait "$serve_pid" 2>/dev/null
  serve_pid=
}
trap stop_server EXIT

# start_server MODE YAML: `halfmoon serve` in the background; waits (at most 240 s) until it
# answers `halfmoon status`.
start_server() {
  local mode=$1 config=$2
  echo "== serve $mode (about 60 s: Ray, weights, start-up profile, CUDA graphs; at most 240 s)" >&2
  "${hm[@]}" serve --config "$config" >"$out/serve-$mode.log" 2>&1 &
  serve_pid=$!  # the Python process itself: SIGTERM stops the cluster cleanly
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt 240 ]; do
    if ! kill -0 "$serve_pid" 2>/dev/null; then
      echo "   serve $mode died (see $out/serve-$mode.log)" >&2
      serve_pid=
      return 1
    fi
    if "${hm[@]}" status --server "$server" --json 2>/dev/null | grep -q "\"mode\": \"$mode\""; then
      echo "   serving after $((SECONDS - t0)) s" >&2
      return 0
    fi
    sleep 2
  done
  echo "   serve $mode did not answer in 240 s (see $out/serve-$mode.log)" >&2
  stop_server
  return 1
}

# config MODE: the cluster's YAML (the defaults of halfmoon.cluster.config, except these).
config() {
  local mode=$1 file=$out/serve-$1.yaml
  if [ "$mode" = disaggregated ]; then
    pools="prefill: {replicas: 1, num_gpus: $num_gpus}
decode: {replicas: 1, num_gpus: $num_gpus}"
  else
    pools="decode: {replicas: 2, num_gpus: $num_gpus}"
  fi
  cat >"$file" <<YAML
model: $model
mode: $mode
engine:
$engine
$pools
router: {policy: conductor}
store: {use_local_redis: $use_redis}
server: {grpc_port: $port, metrics_port: $metrics_port, http_port: "off"}
YAML
  echo "$file"
}

# redis_starts: whether redis-server, when installed, stays up 3 s (unpacked from .debs it
# failed to start on the device once, and `serve` then failed in both modes).
redis_starts() {
  command -v redis-server >/dev/null || return 0
  timeout 3 redis-server --port 0 --unixsocket "/tmp/halfmoon-redis-probe-$$.sock" --save '' \
    --appendonly no >"$out/redis-probe.log" 2>&1
  local rc=$?
  rm -f "/tmp/halfmoon-redis-probe-$$.sock"
  [ "$rc" -eq 124 ]
}
use_redis=true
if ! redis_starts; then
  use_redis=false
  echo "serve-bench: redis-server does not start here ($out/redis-probe.log); serving without" \
    "the Redis tier" >&2
fi
[ -z "$HALFMOON_GPU" ] || echo "serve-bench: one GPU, shared: the disaggregated run's prefill" \
  "and decode workers time-slice it, so it measures the KV transfer path and the engine, not" \
  "pool isolation" >&2

if [ "$model" != null ] && [ ! -f "$model/config.json" ]; then
  step 30 120 init-model "$HALFMOON_PY" -c "
import torch
from halfmoon.engine.init_model import SHAPES, init_model
torch.set_default_dtype(torch.bfloat16)  # written in bf16: half the bytes to write and load
print(init_model('$model', SHAPES['gpu']))" || exit 1
fi

# serve_at MODE RATE: `bench serve` at RATE req/s into serve-MODE-RATErps.json, judged against
# the SLOs. Seeds apart from the live check's (0-2) and each other's: no run finds its prompts
# cached.
serve_at() {
  local mode=$1 rate=$2 count=$num_prompts
  [ -z "${SERVE_BENCH_WINDOW_S:-}" ] || count=$(awk -v r="$rate" -v w="$SERVE_BENCH_WINDOW_S" \
    'BEGIN { n = int(r * w + 0.5); print (n < 12 ? 12 : n) }')
  step 40 "$run_limit" "serve-$mode-${rate}rps" "${hm[@]}" bench serve --server "$server" \
    --num-prompts "$count" "${workload[@]}" --request-rate "$rate" \
    --seed "$(awk -v r="$rate" 'BEGIN { print 100 + int(r * 10 + 0.5) }')" \
    --goodput "${slo[@]}" --metric-percentiles 50,99 --disable-tqdm --json
}

modes=(disaggregated colocated)
for i in "${!modes[@]}"; do
  mode=${modes[$i]}
  start_server "$mode" "$(config "$mode")" || continue
  # The live check first, while the router's profile is still the one measured at start (the
  # runs refit it online; the check also simulates with the refit one). Rates: fractions of the
  # simulated capacity; when the simulator meets the SLOs always (or never) it fails before
  # sending any load, and three fixed rates run instead.
  if [ "${SERVE_BENCH_LIVE:-1}" = 1 ] && ! step 90 200 "live-capacity-$mode" "${hm[@]}" \
      bench live-capacity --server "$server" --num-prompts "$num_prompts" "${workload[@]}" \
      --disable-tqdm --json; then
    mv "$out/live-capacity-$mode.log" "$out/live-capacity-$mode-default-rates.log"
    grep -q "tighten\|loosen" "$out/live-capacity-$mode-default-rates.log" &&
      step 90 200 "live-capacity-$mode" "${hm[@]}" bench live-capacity --server "$server" \
        --num-prompts "$num_prompts" "${workload[@]}" --rates 2,5,8 --disable-tqdm --json
  fi
  for rate in "${rates[@]}"; do serve_at "$mode" "$rate"; done
  for _ in $(seq "${SERVE_BENCH_SEARCH:-0}"); do
    # the search of a mode ends within its share of the budget: the next mode's runs come first
    (((SECONDS - started + run_limit) * ${#modes[@]} <= budget * (i + 1))) || break
    rate=$("${report[@]}" next "$out" "$mode" "$target") && [ -n "$rate" ] || break
    serve_at "$mode" "$rate" || break  # out of budget: the summary says what was met
  done
  "$HALFMOON_PY" -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen(
'http://127.0.0.1:$metrics_port/metrics', timeout=10).read().decode())" \
    >"$out/metrics-$mode.txt" 2>/dev/null || true
  "${hm[@]}" status --server "$server" --json >"$out/status-$mode.json" 2>/dev/null || true
  stop_server
done

# One line per run (what issues 12 and 17 ask for) and the largest rate met, per mode.
"${report[@]}" summary "$out" "$target" "${HALFMOON_GPU:-cpu}" "$use_redis" "${slo[@]}" |
  tee "$out/summary.txt"
echo "serve-bench: done in $((SECONDS - started)) s; results in $out" >&2
