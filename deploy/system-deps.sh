#!/usr/bin/env bash
# Installs the system packages halfmoon's tests and local serving use, when missing.
# `system-deps.sh transfer`: only the Transfer Engine's (the `ray up` nodes, deploy/ray/).
set -euo pipefail
need=()
if [ "${1:-}" != transfer ]; then
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
  # promtool (checks deploy/prometheus/prometheus.yml in the tests) ships in Debian's prometheus.
  command -v promtool >/dev/null 2>&1 || need+=(prometheus)
  # openssl makes the self-signed certificate of the gRPC TLS test.
  command -v openssl >/dev/null 2>&1 || need+=(openssl)
  # g++ builds the CPU kernels (kernels/cpu_build.py); without it the torch references serve.
  command -v g++ >/dev/null 2>&1 || need+=(g++)
fi
# Mooncake's Transfer Engine (KV between machines, docs/deploy.md) links libibverbs, libnuma and
# libcurl even for TCP; its RDMA needs librdmacm and the NICs' verbs drivers (ibverbs-providers,
# whose libmlx5 the CUDA builds link). Without them it does not import and KV goes as Ray objects.
# Looked up by library, so an RDMA stack installed otherwise (OFED, EFA) is left as it is.
libs=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
grep -q 'libibverbs\.so\.1 ' <<<"$libs" || need+=(libibverbs1)
grep -q 'librdmacm\.so\.1 ' <<<"$libs" || need+=(librdmacm1)
grep -q 'libmlx5\.so\.1 ' <<<"$libs" || need+=(ibverbs-providers)
grep -q 'libnuma\.so\.1 ' <<<"$libs" || need+=(libnuma1)
grep -q 'libcurl\.so\.4 ' <<<"$libs" || need+=(libcurl4)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing system packages: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
