#!/usr/bin/env bash
# The GPU suite. On a GPU host with no internet (the device machine) it installs the carried
# wheelhouse (.whl/, from `make wheelhouse`) into /tmp and runs with the host's CUDA torch;
# anywhere else it runs in .venv, where every `gpu` test is skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .whl ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/halfmoon-site .whl/*.whl
  mkdir -p /tmp/halfmoon-src && ln -sfn "$PWD" /tmp/halfmoon-src/halfmoon
  for deb in .whl/deb/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/halfmoon-redis; done
  export PATH="/tmp/halfmoon-redis/usr/bin:$PATH"
  export PYTHONPATH="/tmp/halfmoon-src:/tmp/halfmoon-site${PYTHONPATH:+:$PYTHONPATH}"
  # The kernel tests compiled by Triton (not interpreted, as on CPU), then every `gpu` test.
  python3 -m pytest -p no:cacheprovider -m "not slow" tests/kernels "$@"
  exec python3 -m pytest -p no:cacheprovider -m gpu tests "$@"
fi
exec .venv/bin/python -m pytest -p no:cacheprovider -m gpu tests "$@"
