#!/usr/bin/env bash
# Installs the system packages halfmoon's tests and local serving use, when missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# promtool (checks deploy/prometheus/prometheus.yml in the tests) ships in Debian's prometheus.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# openssl makes the self-signed certificate of the gRPC TLS test.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# g++ builds the CPU kernels (kernels/cpu_build.py); without it the torch references serve.
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing system packages: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
