#!/usr/bin/env bash
# Starts the cluster-wide Redis tier on this (head) node: start-redis.sh PORT MAXMEMORY.
# It listens on the node's private address (and loopback) with the password in
# deploy/ray/secrets/redis-password (make-secrets.sh; given on stdin, not in the process list),
# protected mode on, LRU-evicts and keeps nothing on disk.
set -euo pipefail
port=${1:-6380}
maxmemory=${2:-4gb}
password_file="$(cd "$(dirname "$0")" && pwd)/secrets/redis-password"
if [ ! -s "$password_file" ]; then
    echo "start-redis.sh: $password_file is missing: run deploy/ray/make-secrets.sh first" >&2
    exit 1
fi
address=$(hostname -I | cut -d' ' -f1)
log=/tmp/halfmoon-redis-$port.log
REDISCLI_AUTH=$(cat "$password_file") redis-cli -h "$address" -p "$port" shutdown nosave \
    2>/dev/null || true
printf 'requirepass %s\n' "$(cat "$password_file")" | redis-server - --port "$port" \
  --bind "$address" 127.0.0.1 --protected-mode yes \
  --save "" --appendonly no --maxmemory "$maxmemory" --maxmemory-policy allkeys-lru \
  --daemonize yes --logfile "$log"
# --daemonize returns before the server listens: wait until it answers (or say why it did not).
for _ in $(seq 100); do
    if REDISCLI_AUTH=$(cat "$password_file") redis-cli -h 127.0.0.1 -p "$port" ping \
        2>/dev/null | grep -q PONG; then
        echo "redis://:<deploy/ray/secrets/redis-password>@$address:$port/0"
        exit 0
    fi
    sleep 0.1
done
echo "start-redis.sh: redis-server did not answer on port $port within 10 s; its log:" >&2
tail -n 20 "$log" >&2 || true
exit 1
