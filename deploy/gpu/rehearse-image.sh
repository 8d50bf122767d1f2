#!/usr/bin/env bash
# The CPU kernel and engine tests against the GPU image's versions of Triton, transformers,
# tokenizers and huggingface-hub (deploy/gpu/image-versions.txt), overlaid on .venv: what needs
# a newer release than the device holds fails here instead of in a GPU session. Extra arguments
# go to pytest; REHEARSAL_TESTS (tests/kernels tests/engine) are the tests it runs.
# REHEARSAL_DIR (build/image-overlay) keeps the overlay between runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
versions=deploy/gpu/image-versions.txt
overlay=${REHEARSAL_DIR:-build/image-overlay}
if ! cmp -s "$versions" "$overlay/versions.txt" 2>/dev/null; then
  rm -rf "$overlay" && mkdir -p "$overlay"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    -d "$overlay/wheels" -r "$versions"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$overlay/site" \
    "$overlay"/wheels/*.whl
  cp "$versions" "$overlay/versions.txt"
fi
export PYTHONPATH="$overlay/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import numpy, tokenizers, transformers, triton
print("rehearse-image: triton", triton.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "numpy", numpy.__version__)'
"$PY" -m pytest -p no:cacheprovider -q -m "not slow" -W ignore::DeprecationWarning \
  ${REHEARSAL_TESTS:-tests/kernels tests/engine} "$@"
