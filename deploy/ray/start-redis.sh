#!/usr/bin/env bash
# Starts the cluster-wide Redis tier on this (head) node: start-redis.sh PORT MAXMEMORY.
# It listens on the node's private address, LRU-evicts and keeps nothing on disk.
set -euo pipefail
port=${1:-6380}
maxmemory=${2:-4gb}
address=$(hostname -I | cut -d' ' -f1)
redis-cli -h "$address" -p "$port" shutdown nosave 2>/dev/null || true
redis-server --port "$port" --bind "$address" 127.0.0.1 --protected-mode no \
  --save "" --appendonly no --maxmemory "$maxmemory" --maxmemory-policy allkeys-lru \
  --daemonize yes --logfile /tmp/halfmoon-redis.log
echo "redis://$address:$port/0"
