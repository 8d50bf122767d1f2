# Sourced by the GPU scripts: on a GPU host with no internet (the device machine), install the
# carried wheelhouse (.whl/, from `make wheelhouse`) under /tmp/halfmoon-offline and put it and
# halfmoon on PYTHONPATH (deploy/gpu/wheelhouse.py install), so the host's CUDA torch runs it.
# The install runs once per wheelhouse: a stamp in the prefix holds its wheelhouse.json's digest,
# so sourcing this again (each script, each step of a session) costs about a second.
# Sets HALFMOON_PY to the Python to use and HALFMOON_GPU to 1 there.
if [ -d .whl ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  if ! offline_env=$(python3 deploy/gpu/wheelhouse.py install --wheelhouse .whl --print-env); then
    echo "env.sh: installing the wheelhouse .whl/ failed (above)" >&2
    return 1
  fi
  eval "$offline_env"
  HALFMOON_PY=python3
  HALFMOON_GPU=1
else
  HALFMOON_PY=.venv/bin/python
  HALFMOON_GPU=
fi
