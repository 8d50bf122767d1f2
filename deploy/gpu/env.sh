# Sourced by the GPU scripts: on a GPU host with no internet (the device machine), install the
# carried wheelhouse (.whl/, from `make wheelhouse`) into /tmp and put halfmoon on PYTHONPATH,
# so the host's CUDA torch runs it. Sets HALFMOON_PY to the Python to use.
if [ -d .whl ] && python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/halfmoon-site .whl/*.whl
  mkdir -p /tmp/halfmoon-src && ln -sfn "$PWD" /tmp/halfmoon-src/halfmoon
  for deb in .whl/deb/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/halfmoon-redis; done
  export PATH="/tmp/halfmoon-redis/usr/bin:$PATH"
  # redis-server links liblzf and libjemalloc, which the image lacks: unpacked from the .debs.
  export LD_LIBRARY_PATH="/tmp/halfmoon-redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="/tmp/halfmoon-src:/tmp/halfmoon-site${PYTHONPATH:+:$PYTHONPATH}"
  HALFMOON_PY=python3
  HALFMOON_GPU=1
else
  HALFMOON_PY=.venv/bin/python
  HALFMOON_GPU=
fi
