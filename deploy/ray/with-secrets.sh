#!/usr/bin/env bash
# Runs a command (`halfmoon serve ...`, `halfmoon status`, `ray status`) with the cluster's
# secrets from deploy/ray/secrets/ (make-secrets.sh) in the environment halfmoon and Ray read:
# Ray's token auth, the API key both APIs require, the Redis tier's password and the HMAC key
# of its records. Values travel in the environment, never on a command line `ps` shows.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
for name in ray-token api-key redis-password redis-hmac-key; do
    if [ ! -s "$dir/$name" ]; then
        echo "with-secrets.sh: $dir/$name is missing: run deploy/ray/make-secrets.sh" >&2
        exit 1
    fi
done
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$dir/ray-token"
HALFMOON_API_KEY=$(cat "$dir/api-key")
HALFMOON_REDIS_PASSWORD=$(cat "$dir/redis-password")
HALFMOON_REDIS_HMAC_KEY=$(cat "$dir/redis-hmac-key")
export HALFMOON_API_KEY HALFMOON_REDIS_PASSWORD HALFMOON_REDIS_HMAC_KEY
exec "$@"
