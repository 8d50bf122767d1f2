# The two commands a newcomer runs: `make serve` and `make test`. Both set everything up.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test test-fast test-gpu bench-gpu wheelhouse lint format system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build on disk, a range would pull CUDA builds.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

system-deps:
	bash deploy/system-deps.sh

serve: $(STAMP) system-deps
	$(VENV)/bin/halfmoon serve $(ARGS)

test: $(STAMP) system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) system-deps
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

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

# Wheels and .debs the GPU host lacks (Python 3.12, x86_64), into .whl/ (ignored by git).
wheelhouse: $(STAMP)
	bash deploy/gpu/wheelhouse.sh

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
