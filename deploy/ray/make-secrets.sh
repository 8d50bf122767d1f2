#!/usr/bin/env bash
# Writes the cluster's secrets once, on the machine `ray up` runs from, into deploy/ray/secrets/
# (ignored by git, mode 600; file_mounts copies it to every node with the checkout): Ray's auth
# token (`RAY_AUTH_MODE=token` on every node), the Redis tier's password, halfmoon's API key
# and the HMAC key of Redis records. Run it again: existing secrets are kept.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
umask 077
mkdir -p "$dir"
for name in ray-token redis-password api-key redis-hmac-key; do
    [ -s "$dir/$name" ] || python3 -c 'import secrets; print(secrets.token_hex(32))' >"$dir/$name"
done
echo "secrets in $dir: ray-token redis-password api-key redis-hmac-key"
