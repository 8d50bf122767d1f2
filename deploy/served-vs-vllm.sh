#!/usr/bin/env bash
# Served, with vLLM's client: `vllm bench serve` against `vllm serve`, the default 1+1
# `halfmoon serve` and a colocated one, one server at a time, each started afresh for each
# client run (the prompts repeat at every rate, and a server that served them before would
# answer from its prefix cache), servers alternating within a round. docs/benchmarks.md,
# "Served, with vLLM's client", has the figures and why each setting is what it is.
#
#   make peers && make bench-served-vllm          # or: bash deploy/served-vs-vllm.sh
#   RATES="1 inf" SERVERS="vllm disagg colocated" ROUNDS=2 bash deploy/served-vs-vllm.sh
#
# Settings (environment): RATES (req/s; "inf": all at once), SERVERS, ROUNDS, PORT (8011),
# MODEL (the ~50M fp32 checkpoint `halfmoon bench engine` makes), OUT (logs; a new folder in
# /tmp). Prints one line a run: server, rate, time, output tok/s, mean TTFT and TPOT (ms).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
RATES=${RATES:-"1 inf"}
SERVERS=${SERVERS:-"vllm disagg colocated"}
ROUNDS=${ROUNDS:-1}
PORT=${PORT:-8011}
MODEL=${MODEL:-$HOME/.cache/halfmoon/bench-50m}
OUT=${OUT:-$(mktemp -d /tmp/served-vs-vllm.XXXX)}
PEERS=.peers-venv/bin
[ -x "$PEERS/vllm" ] || { echo "no $PEERS/vllm: run \`make peers\` first" >&2; exit 2; }
[ -x .venv/bin/halfmoon ] || { echo "no .venv/bin/halfmoon: run \`make serve\` or \`make test\` first" >&2; exit 2; }
if [ ! -f "$MODEL/config.json" ]; then  # the checkpoint `bench engine` runs, made on first use
    .venv/bin/halfmoon init-model --shape bench "$MODEL"
fi
export RAY_AUTH_MODE=disabled
printf 'mode: colocated\ndecode: {replicas: 1, num_cpus: 2}\n' > "$OUT/colocated.yaml"
halfmoon=(.venv/bin/halfmoon serve --model "$MODEL" --served-model-name bench --http-port "$PORT"
          --port 0 --metrics-port 0)
server=

stop_server() {
    [ -n "$server" ] || return 0
    kill -INT -- "-$server" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server" 2>/dev/null || true
    server=
    sleep 3
}
trap stop_server EXIT

start_server() {  # $1: vllm | disagg | colocated; $2: its log
    case $1 in
        vllm) VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 setsid "$PEERS/vllm" serve "$MODEL" \
                  --dtype float32 --max-model-len 2048 --max-num-seqs 64 \
                  --no-enable-prefix-caching --served-model-name bench --port "$PORT" > "$2" 2>&1 & ;;
        disagg) setsid "${halfmoon[@]}" > "$2" 2>&1 & ;;
        colocated) setsid "${halfmoon[@]}" --config "$OUT/colocated.yaml" > "$2" 2>&1 & ;;
        *) echo "unknown server $1 (vllm, disagg, colocated)" >&2; exit 2 ;;
    esac
    server=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
        kill -0 "$server" 2>/dev/null || { echo "$1 exited while starting: $2" >&2; exit 1; }
        sleep 1
    done
    echo "$1 did not answer /v1/models in 300 s: $2" >&2
    exit 1
}

echo "logs in $OUT"
for round in $(seq "$ROUNDS"); do
    for rate in $RATES; do
        for name in $SERVERS; do
            log="$OUT/$name-$rate-$round"
            start_server "$name" "$log.server.log"
            timeout 600 "$PEERS/vllm" bench serve --backend openai-chat \
                --endpoint /v1/chat/completions --dataset-name random --random-input-len 256 \
                --random-output-len 64 --num-prompts 64 --request-rate "$rate" --ignore-eos \
                --seed 3 --temperature 0 --model bench --tokenizer "$MODEL" \
                --base-url "http://127.0.0.1:$PORT" > "$log.client.log" 2>&1 || true
            stop_server
            figures=$(grep -E 'Output token throughput|Mean TTFT|Mean TPOT' "$log.client.log" \
                      | awk -F: '{gsub(/ /, "", $2); printf "%s ", $2}')
            echo "$name R=$rate $(date +%H:%M) tok/s, TTFT ms, TPOT ms: ${figures:-no result (see $log.client.log)}"
        done
    done
done
