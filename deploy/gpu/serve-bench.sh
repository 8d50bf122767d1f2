#!/usr/bin/env bash
# Issue 12's serving benchmark and issue 17's live capacity check, on one GPU, in one run:
# `halfmoon serve` with the ~0.9B bf16 bench model (SHAPES['gpu']), disaggregated 1P+1D and
# then colocated with 2 workers (num_gpus 0.3 each); in each mode `bench serve` at 2 and 8 req/s
# (48 requests, prompts 512-2048 tokens, 128 output tokens, Poisson) and `bench live-capacity`
# at three rates (fractions of the simulated capacity). JSON and logs go to $OUT (default
# bench-gpu/). Every step is bounded by `timeout` and by a budget of $SERVE_BENCH_BUDGET_S
# (default 540 s) so the whole run stays inside the device's 10 minutes; about 6-7 minutes.
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
  workload=(--num-prompts 48 --random-input-len 1280 --random-range-ratio 0.6
            --random-output-len 128 --random-output-range-ratio 0)
elif [ -n "${SERVE_BENCH_CPU:-}" ]; then
  model=null  # the tiny default model
  engine="  num_pages: 1024"
  num_gpus=0
  workload=(--num-prompts 8 --random-input-len 256 --random-range-ratio 0.5
            --random-output-len 16 --random-output-range-ratio 0)
  echo "serve-bench: no GPU; SERVE_BENCH_CPU=1: a CPU rehearsal with the tiny model" >&2
else
  echo "serve-bench: no CUDA GPU here (and/or no .whl wheelhouse); nothing to measure" >&2
  exit 0
fi
mkdir -p "$out"
hm=("$HALFMOON_PY" -m halfmoon.cluster.cli)  # an array, not a function: `timeout` runs it
started=$SECONDS
budget=${SERVE_BENCH_BUDGET_S:-540}

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

for mode in disaggregated colocated; do
  start_server "$mode" "$(config "$mode")" || continue
  # The live check first, while the router's profile is still the one measured at start (the
  # runs refit it online; the check also simulates with the refit one). Rates: fractions of the
  # simulated capacity; when the simulator meets the SLOs always (or never) it fails before
  # sending any load, and three fixed rates run instead.
  if ! step 90 200 "live-capacity-$mode" "${hm[@]}" bench live-capacity --server "$server" \
      "${workload[@]}" --disable-tqdm --json; then
    mv "$out/live-capacity-$mode.log" "$out/live-capacity-$mode-default-rates.log"
    grep -q "tighten\|loosen" "$out/live-capacity-$mode-default-rates.log" &&
      step 90 200 "live-capacity-$mode" "${hm[@]}" bench live-capacity --server "$server" \
        "${workload[@]}" --rates 2,5,8 --disable-tqdm --json
  fi
  # Seeds apart from the check's (0-2) and each other's: no run finds its prompts cached.
  for rate in 2 8; do
    step 40 150 "serve-$mode-${rate}rps" "${hm[@]}" bench serve --server "$server" "${workload[@]}" \
      --request-rate "$rate" --seed $((100 + rate)) --metric-percentiles 50,99 --disable-tqdm \
      --json
  done
  "$HALFMOON_PY" -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen(
'http://127.0.0.1:$metrics_port/metrics', timeout=10).read().decode())" \
    >"$out/metrics-$mode.txt" 2>/dev/null || true
  "${hm[@]}" status --server "$server" --json >"$out/status-$mode.json" 2>/dev/null || true
  stop_server
done

# One line per run: what issues 12 and 17 ask for.
"$HALFMOON_PY" - "$out" "$use_redis" "$HALFMOON_GPU" <<'PYTHON'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
if sys.argv[3]:
    print("one GPU shared by every worker: disaggregated figures measure the KV transfer path "
          "and the engine, not prefill/decode pool isolation (two processes time-slice one GPU)")
if sys.argv[2] != "true":
    print("served without the Redis tier: redis-server did not start")


def load(name, label):
    """The JSON result `name` in the output folder, or None after saying it is missing."""
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        print(f"{label}: no result ({out / name})")
        return None


for mode in ("disaggregated", "colocated"):
    for rate in (2, 8):
        r = load(f"serve-{mode}-{rate}rps.json", f"{mode:>13} {rate} req/s")
        if r is None:
            continue
        print(
            f"{mode:>13} {rate} req/s: TTFT p50 {r['median_ttft_ms']:.0f} / p99 "
            f"{r['p99_ttft_ms']:.0f} ms, ITL mean {r['mean_itl_ms']:.1f} / p99 "
            f"{r['p99_itl_ms']:.0f} ms, {r['output_throughput']:.0f} output tok/s, "
            f"{r['failed']} failed"
        )
    r = load(f"live-capacity-{mode}.json", f"{mode:>13} live capacity")
    if r is None:
        continue
    rows = ", ".join(
        f"{x['rate_rps']:.2f} req/s live {x['live_attainment']:.2f} sim "
        f"{x['simulated_attainment']:.2f}" for x in r["rates"]
    )
    print(f"{mode:>13} live vs simulated attainment (agree within 0.1: {r['all_agree']}): {rows}")
PYTHON
echo "serve-bench: done in $((SECONDS - started)) s; results in $out" >&2
